"""A training run's directory: new, continued, cleared or versioned, and never mixed.

Settled once, on rank 0, before anything loads (`settle_run_dir`):

- a new run (no --resume_from_checkpoint) needs an empty or absent --output_dir; one that
  holds files is refused with the ways out (continue it, another folder, delete it, version);
- --overwrite_output_dir true deletes the earlier run first: a swiftlm run directory only,
  never one that holds an input of this run;
- --add_version true writes into `<output_dir>/v<N>-<timestamp>`, N one above the highest
  version there (ms-swift's naming); the folder is made at once, so a restart finds it;
- a worker that torchrun restarted (--max_restarts) continues the run its first attempt
  started: `auto` in the same folder (with --add_version, the newest version), never refused
  nor cleared, though its command line is the first attempt's (--overwrite_output_dir
  included). Which run that is, a mark in the folder says (LAUNCH_MARK, written by rank 0 once
  the folder is settled): a first attempt that was refused, or stopped before, started none,
  and its restart is settled as a first attempt again.

The settled config names the folder itself and turns both flags off, so that a rerun of the
run's saved config.yaml neither deletes nor versions anything.
"""

import dataclasses
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from swiftlm.checkpoint.targets import RUN_MARKERS, is_run_dir, newest_complete, run_dir_of
from swiftlm.config import TrainConfig
from swiftlm.data.sources import parse_dataset_spec
from swiftlm.distributed.launch import launched_by_torchrun
from swiftlm.errors import ConfigError

VERSION = re.compile(r"v(\d+)")  # a version folder's name starts so (ms-swift's test too)
LAUNCH_MARK = ".launch"  # under torchrun: the launch whose run this folder holds


def restarted_by_torchrun() -> bool:
    """A worker that torchrun restarted (--max_restarts) after a worker failed."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def settle_run_dir(cfg: TrainConfig, log) -> TrainConfig:
    """`cfg` with the folder this run writes to, made ready as its flags ask (see above).

    Assumes the flag rules hold (`config/rules_run_dir.py`) and that --output_dir is not a
    file (`preflight.check_paths`). Without --output_dir, the default one (a timestamp,
    `resolve.default_run_dir`) is new: nothing to settle."""
    out = cfg.output
    given = Path(out.output_dir) if out.output_dir is not None else None
    started = _started_run(given, out.add_version) if restarted_by_torchrun() else None
    if started is not None:
        return _settled(cfg, started, _restart_resume(started, out.resume_from_checkpoint))
    folder = _first_attempt_folder(cfg, given, log)
    if folder is not None and launched_by_torchrun():
        _mark_launch(folder)
    return _settled(cfg, folder, out.resume_from_checkpoint)


def _first_attempt_folder(cfg: TrainConfig, given: Path | None, log) -> Path | None:
    """The folder a run writes to, made ready: versioned, emptied, or checked unused."""
    out = cfg.output
    if given is None:
        return None
    if out.add_version:
        return _new_version(given, log)
    if out.overwrite_output_dir:
        _delete_earlier_run(given, cfg, log)
    elif not _continues_a_run_in(given, out.resume_from_checkpoint):
        _refuse_if_used(given)
    return given


def _settled(cfg: TrainConfig, folder: Path | None, resume: str | None) -> TrainConfig:
    output = dataclasses.replace(
        cfg.output,
        output_dir=None if folder is None else str(folder),
        resume_from_checkpoint=resume,
        overwrite_output_dir=False,
        add_version=False,
    )
    return dataclasses.replace(cfg, output=output)


def _this_launch() -> str:
    """This worker's launch: torchrun's agent (the workers' parent) on this host, the same
    process for every restart. Rank 0, which settles the folder, runs on the first node."""
    return f"{socket.gethostname()}:{os.getppid()}"


def _mark_launch(folder: Path) -> None:
    """Record that this launch's run is the one in `folder`, for its restarts."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LAUNCH_MARK).write_text(_this_launch() + "\n")


def _started_run(given: Path | None, add_version: bool) -> Path | None:
    """The folder whose run this launch's first attempt started (None: it started none)."""
    if given is None:
        return None
    folder = _newest_version(given) if add_version else given
    mark = folder / LAUNCH_MARK if folder is not None else None
    if mark is None or not mark.is_file():
        return None
    return folder if mark.read_text().strip() == _this_launch() else None


def _restart_resume(folder: Path, resume: str | None) -> str:
    """A restart resumes from the newest checkpoint of its run; before the first one is
    saved, from what the first attempt resumed (or from scratch: `auto` finds nothing)."""
    if newest_complete(folder) is not None:
        return "auto"
    return resume or "auto"


def _continues_a_run_in(folder: Path, resume: str | None) -> bool:
    """Whether the run resumes a checkpoint of the run in `folder` (so may write there)."""
    if resume is None:
        return False
    if resume == "auto":
        return True
    run = run_dir_of(Path(resume).expanduser())
    return run is not None and folder.exists() and run.resolve() == folder.resolve()


# ---- a folder that holds something -----------------------------------------------------------


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _listing(entries: list[Path], most: int = 4) -> str:
    """`config.yaml, checkpoints/, final/ and 2 more`: what a folder holds, in short."""
    names = [p.name + ("/" if p.is_dir() else "") for p in entries]
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _refuse_if_used(folder: Path) -> None:
    entries = _entries(folder)
    if not entries:
        return
    version = (
        f"--add_version true to write this run into a fresh subfolder {folder}/v<N>-<timestamp>"
    )
    if is_run_dir(folder):
        raise ConfigError(
            f"--output_dir {folder} holds an earlier run ({_listing(entries)}); a new run there "
            "would mix its checkpoints and logs with it. Choose one: --resume_from_checkpoint "
            "auto to continue it; a new --output_dir; --overwrite_output_dir true to delete it "
            f"and start over; or {version}"
        )
    raise ConfigError(
        f"--output_dir {folder} is not empty ({_listing(entries)}) and is not a swiftlm run "
        f"directory; choose a new or empty --output_dir, or {version}"
    )


def _delete_earlier_run(folder: Path, cfg: TrainConfig, log) -> None:
    """--overwrite_output_dir: empty `folder`, if it is a run that holds none of this run's
    inputs and no other run (such as a version folder of --add_version)."""
    entries = _entries(folder)
    if not entries:
        return
    if not is_run_dir(folder):
        raise ConfigError(
            f"--overwrite_output_dir true: {folder} is not a swiftlm run directory (it holds "
            f"{_listing(entries)}; a run has one of {', '.join(RUN_MARKERS)}), so swiftlm is "
            "refusing to delete it; choose a new --output_dir"
        )
    inside = [f"{flag} {path}" for flag, path in _input_paths(cfg) if _is_within(path, folder)]
    inside += [f"the run {entry}" for entry in entries if entry.is_dir() and is_run_dir(entry)]
    if inside:
        raise ConfigError(
            f"--overwrite_output_dir true would delete {inside[0]}, which is inside --output_dir "
            f"{folder}; move it out first, or choose a new --output_dir"
        )
    deleted = _listing(entries, most=len(entries))  # every name: nothing goes unmentioned
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    log(f"--overwrite_output_dir: deleted the earlier run in {folder} ({deleted})")


def _input_paths(cfg: TrainConfig) -> Iterator[tuple[str, str]]:
    """(flag, path) of every local file or folder this run reads."""
    if cfg.model.model:
        yield "--model", cfg.model.model
    for flag, specs in (("--dataset", cfg.data.dataset), ("--val_dataset", cfg.data.val_dataset)):
        for spec in specs:
            yield flag, parse_dataset_spec(spec)[0]
    if cfg.dist.deepspeed:
        yield "--deepspeed", cfg.dist.deepspeed


def _is_within(path: str, folder: Path) -> bool:
    target = Path(path).expanduser()
    return target.exists() and target.resolve().is_relative_to(folder.resolve())


# ---- versions ---------------------------------------------------------------------------------


def next_version_dir(base: Path, stamp: str | None = None) -> Path:
    """`<base>/v<N>-<timestamp>`, N one above the highest version in `base` (ms-swift's name)."""
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    names = os.listdir(base) if base.is_dir() else []
    highest = max((int(m.group(1)) for m in map(VERSION.match, names) if m), default=-1)
    return base / f"v{highest + 1}-{stamp}"


def _new_version(base: Path, log) -> Path:
    folder = next_version_dir(base)
    folder.mkdir(parents=True)
    log(f"--add_version: this run writes to {folder}")
    return folder


def _newest_version(base: Path) -> Path | None:
    """The version folder of `base` with the highest N, if any."""
    numbered = [
        (int(match.group(1)), entry)
        for entry in _entries(base)
        if entry.is_dir() and (match := VERSION.match(entry.name))
    ]
    return max(numbered)[1] if numbered else None
