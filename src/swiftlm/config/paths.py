"""Checks of a path a flag names, done before anything loads (pure filesystem look-ups).

A folder that a command will write (`--output_dir`) must not be a file, nor sit below one,
and a file it will write (`--result_path`) must not be a folder: writing would otherwise fail
with a bare OSError after the model has loaded, or after the work is done.
"""

from pathlib import Path

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
