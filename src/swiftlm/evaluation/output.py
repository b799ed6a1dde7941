"""Where an evaluation writes, and how `--compare` finds an evaluation's folder."""

import json
import re
from datetime import datetime
from pathlib import Path

from swiftlm.errors import ConfigError

PREDICTIONS = "predictions.jsonl"


def output_dir(cfg, spec, backend) -> Path:
    """--eval_output_dir, else <run dir>/eval/<timestamp> for a run, else
    eval_output/<model>-<timestamp>; created now, so a bad path fails before any work."""
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
    if cfg.eval.eval_output_dir:
        out = Path(cfg.eval.eval_output_dir).expanduser()
    elif spec is not None and spec.ckpt_dir:
        out = Path(spec.ckpt_dir) / "eval" / stamp
    else:
        name = (spec.base_name or spec.description) if spec is not None else backend.description
        out = Path("eval_output") / f"{_safe(name)}-{stamp}"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--eval_output_dir {out}: cannot create the folder ({exc})") from None
    return out


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")[:80] or "model"


def resolve_compare_folder(folder: str) -> Path:
    """An evaluation folder as given, or a training run's newest evaluation (`<run>/eval/*`)."""
    path = Path(folder).expanduser()
    if (path / PREDICTIONS).is_file() or not (path / "eval").is_dir():
        return path
    done = sorted(p for p in (path / "eval").iterdir() if (p / PREDICTIONS).is_file())
    if not done:
        raise ConfigError(
            f"--compare {folder}: the run has an eval/ folder but no finished evaluation in it; "
            f"run `swiftlm eval --ckpt_dir {folder} --eval_dataset ...` first"
        )
    return done[-1]


def write_json(path: Path, data: dict) -> None:
    """Written whole, then renamed into place: a reader never sees half a file."""
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    staging.replace(path)
