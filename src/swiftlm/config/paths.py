"""Checks of a path a flag names, done before anything loads (pure filesystem look-ups).

A folder that a command will write (`--output_dir`) must not be a file, nor sit below one,
and a file it will write (`--result_path`) must not be a folder: writing would otherwise fail
with a bare OSError after the model has loaded, or after the work is done. Whether an output
may replace what is there is `outputs.py`'s question.

An input path that exists must be the kind its flag reads (`INPUT_KINDS`, checked by
`check_input_kinds`; `--external_plugins` by the plugin loader, before the flags are parsed).
The other input flags are checked where they are read, still before any model loads:
--model/--ref_model/--teacher_model (a folder or a .gguf file: `models/`), --ckpt_dir and
--adapters (`checkpoint/targets.py`), --resume_from_checkpoint (`train/preflight.py`), report's
run directories (`report/run_data.py`) and --compare (`evaluation/output.py`). A dataset flag
takes a file or a folder (every file in it is read), so its kind needs no check.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swiftlm.config.checks import flag_values
from swiftlm.errors import ConfigError


def check_writable_folder(path: str, flag: str) -> None:
    """Raise a ConfigError when `path`, or a folder above it, is an existing file."""
    target = Path(path).expanduser()
    file = _first_file(target, *target.parents)
    if file is not None:
        raise ConfigError(
            f"{flag} {path}: {file} is a file; pass a folder (a new one, or one that swiftlm wrote)"
        )


def check_writable_file(path: str, flag: str) -> None:
    """Raise a ConfigError when `path` is a folder, or a folder above it is a file."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; pass a file path such as {path}/out.jsonl")
    file = _first_file(*target.parents)
    if file is not None:
        raise ConfigError(f"{flag} {path}: {file} is a file, so it cannot hold {target.name}")


def _first_file(*paths: Path) -> Path | None:
    return next((p for p in paths if p.exists() and not p.is_dir()), None)


@dataclass(frozen=True)
class PathKind:
    """What an input flag's path must be when it exists: a file (ending in one of `suffixes`,
    when given) or a folder. `takes` names what the flag takes, for the message."""

    folder: bool
    takes: str
    suffixes: tuple[str, ...] = ()


PLUGIN_FILE = PathKind(
    False, "a Python file that registers plugins (see docs/plugins.md)", (".py",)
)

# Input flag -> the kind of path it reads. A value that is no existing path (a preset name, a
# hub id, a URL) is left to the code that reads it.
INPUT_KINDS = {
    "deepspeed": PathKind(
        False,
        "a DeepSpeed JSON config, or a preset: zero1, zero2, zero3, zero2_offload, zero3_offload",
        (".json",),
    ),
    "images": PathKind(False, "image files, http(s) URLs or data URLs"),
}


def check_input_path(path: str, flag: str, kind: PathKind) -> None:
    """Raise a ConfigError when `path` exists but is not the kind of path `flag` reads."""
    target = Path(path).expanduser()
    if not target.exists():
        return
    if kind.folder and not target.is_dir():
        raise ConfigError(f"{flag} {path} is a file; pass {kind.takes}")
    if not kind.folder and target.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; pass {kind.takes}")
    if kind.suffixes and target.suffix.lower() not in kind.suffixes:
        raise ConfigError(
            f"{flag} {path} is a {target.suffix or 'suffix-less'} file, not "
            f"{' or '.join(kind.suffixes)}; pass {kind.takes}"
        )


def check_input_kinds(cfg: Any) -> None:
    """Check every INPUT_KINDS flag of a command config (each value of a list flag)."""
    values = flag_values(cfg)
    for name, kind in INPUT_KINDS.items():
        value = values.get(name)
        for path in value if isinstance(value, list) else [value]:
            if path:
                check_input_path(str(path), f"--{name}", kind)
