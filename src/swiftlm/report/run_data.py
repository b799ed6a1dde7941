"""Read what a training run left in its run directory, for the report and the live dashboard.

The run directory is the contract between the training loop (the writer) and the report (the
reader): `metrics.jsonl` (one row per logged step; evaluation rows carry `eval_*` keys),
`anomalies.jsonl`, `grad_histograms.jsonl`, `data_health.json`, `summary.json`, `config.yaml`
and `profile/top_operators.txt`. Only `metrics.jsonl` is required for a report; every other
file may be absent and its section then says so.

Reading is tolerant where a live run makes it necessary (the last line of a JSONL file may be
half written) and strict elsewhere (a damaged line in the middle is an error naming file:line),
so a report never silently drops data.
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from swiftlm.errors import ConfigError

METRICS = "metrics.jsonl"
ANOMALIES = "anomalies.jsonl"
HISTOGRAMS = "grad_histograms.jsonl"
DATA_HEALTH = "data_health.json"
SUMMARY = "summary.json"
CONFIG = "config.yaml"
TOP_OPERATORS = "profile/top_operators.txt"
# Every file the report reads: the dashboard redraws when any of them changes.
WATCHED = (METRICS, ANOMALIES, HISTOGRAMS, DATA_HEALTH, SUMMARY, CONFIG, TOP_OPERATORS)


@dataclass
class RunData:
    """One run directory, parsed. `train` and `eval` hold one row per step (the last one logged
    for that step: a resumed run appends and may log a step again), sorted by step."""

    name: str
    path: Path
    train: list[dict] = field(default_factory=list)
    eval: list[dict] = field(default_factory=list)
    anomalies: list[dict] = field(default_factory=list)
    histograms: list[dict] = field(default_factory=list)
    data_health: dict | None = None
    summary: dict | None = None
    config: dict | None = None
    top_operators: str | None = None

    def latest_step(self) -> int | None:
        steps = [row["step"] for row in self.train + self.eval]
        return max(steps) if steps else None


def is_number(value: Any) -> bool:
    """A plottable scalar: int or float (not bool), finite or not (NaN is plotted as a gap)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite(value: Any) -> float | None:
    """The value as a float for JSON and plotly, None (a gap) where it is not finite."""
    if not is_number(value) or not math.isfinite(value):
        return None
    return float(value)


def read_jsonl(path: Path) -> list[dict]:
    """Every JSON object of a JSONL file; [] when the file is absent. The last line may be cut
    off by a writer still at work (a live run, or one killed mid-write) and is then skipped;
    a bad line before it is an error naming the file and line."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break  # half written: the next read will see it whole
            raise ConfigError(
                f"{path}:{number}: not a JSON object ({exc.msg}); the file is damaged: "
                "delete that line and run `swiftlm report` again"
            ) from None
        if isinstance(row, dict) and is_number(row.get("step")):
            rows.append(row)
    return rows


# Evaluation keys: the validation loss and method metrics (eval_loss, eval_<name>) and the
# generation tasks' scores (eval/<task>/<metric>).
EVAL_PREFIXES = ("eval_", "eval/")


def is_eval_key(key: str) -> bool:
    return key.startswith(EVAL_PREFIXES)


def split_metrics(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """Training rows and evaluation rows, one per step, the last logged winning; a row with
    both kinds of key is split in two."""
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for row in rows:
        step = int(row["step"])
        eval_part = {k: v for k, v in row.items() if is_eval_key(k)}
        train_part = {k: v for k, v in row.items() if not is_eval_key(k) and k != "step"}
        if eval_part:
            evals[step] = {"step": step, **eval_part}
        if train_part:
            train[step] = {"step": step, **train_part}
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None  # being rewritten right now, or damaged: the section says not recorded
    return data if isinstance(data, dict) else None


def _read_yaml(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None


def check_run_dir(path: Path, require_metrics: bool = True) -> None:
    """A clear error for a path that is not a run directory (the report's only input)."""
    if not path.exists():
        raise ConfigError(
            f"run directory {path} does not exist; give the --output_dir of a training run"
        )
    if not path.is_dir():
        raise ConfigError(
            f"{path} is a file, not a run directory; give the --output_dir of a training run"
        )
    if require_metrics and not (path / METRICS).is_file():
        raise ConfigError(
            f"{path} has no {METRICS}: it is not a training run directory, or the run has not "
            "logged a step yet (wait for the first --logging_steps, or use --serve to watch it)"
        )


def load_run(path: Path, require_metrics: bool = True) -> RunData:
    """Parse one run directory. `require_metrics=False` (the live dashboard, started before the
    first step) accepts a directory without metrics.jsonl yet."""
    path = Path(path)
    check_run_dir(path, require_metrics)
    train, evals = split_metrics(read_jsonl(path / METRICS))
    operators = path / TOP_OPERATORS
    return RunData(
        name=path.resolve().name,
        path=path,
        train=train,
        eval=evals,
        anomalies=read_jsonl(path / ANOMALIES),
        histograms=read_jsonl(path / HISTOGRAMS),
        data_health=_read_json(path / DATA_HEALTH),
        summary=_read_json(path / SUMMARY),
        config=_read_yaml(path / CONFIG),
        top_operators=operators.read_text(encoding="utf-8") if operators.is_file() else None,
    )


def unique_names(runs: list[RunData]) -> None:
    """Two runs called `run` (a/run, b/run) get their parent's name too, so traces differ."""
    names = [run.name for run in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = f"{run.path.resolve().parent.name}/{run.name}"


def version(path: Path) -> str:
    """Changes whenever a file the report reads changes (size and mtime of each)."""
    parts = []
    for name in WATCHED:
        try:
            stat = (path / name).stat()
            parts.append(f"{stat.st_size}.{stat.st_mtime_ns}")
        except OSError:
            parts.append("-")
    return ":".join(parts)


def thin(rows: list[dict], limit: int) -> list[dict]:
    """At most about `limit` rows, evenly spaced, the last one always kept: the live page of a
    long run redraws in bounded time (the written report keeps every row)."""
    if len(rows) <= limit:
        return rows
    stride = math.ceil(len(rows) / limit)
    kept = rows[::stride]
    return kept if kept[-1] is rows[-1] else [*kept, rows[-1]]
