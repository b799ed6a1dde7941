"""Checkpoint folders of a run: names, the COMPLETE marker, listing, pruning, and atomic
writing of a loadable model folder. Which folder a run resumes from is `targets.py`.

`COMPLETE` is written last: a folder without it is a checkpoint that was interrupted and is
never resumed from.
"""

import shutil
from pathlib import Path

from swiftlm.checkpoint import blocks

COMPLETE = "COMPLETE"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step}"


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE).is_file()


def step_of(folder: Path) -> int:
    return int(folder.name[5:])


def list_checkpoints(run_dir: Path) -> tuple[list[Path], list[Path]]:
    """(complete, incomplete) checkpoint folders of a run, oldest first."""
    root = run_dir / "checkpoints"
    folders = (
        sorted(
            (p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()),
            key=step_of,
        )
        if root.is_dir()
        else []
    )
    return [p for p in folders if is_complete(p)], [p for p in folders if not is_complete(p)]


def mark_complete_when_written(folder: Path, step: int, pending=None) -> None:
    """Write `COMPLETE` now, or, for a background save, once its data is all on disk.

    On rank 0 the future of `dcp.async_save` ends after every rank's shards and the metadata
    are written; a failed save leaves the folder incomplete.
    """

    def mark(future=None) -> None:
        if future is None or future.exception() is None:
            (folder / COMPLETE).write_text(f"step {step}\n")

    if pending is None:
        mark()
    else:
        pending.add_done_callback(mark)


def prune_checkpoints(run_dir: Path, keep: int | None, protect: Path | None = None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond `keep`; never the newest complete one,
    nor `protect` (the best checkpoint), which does not count towards `keep`.

    Incomplete folders older than the newest complete checkpoint are leftovers of a crash
    and are removed too. Blocks of incremental checkpoints (`blocks.py`) that no remaining
    folder references are deleted after them.
    """
    complete, incomplete = list_checkpoints(run_dir)
    removed = []
    if keep is not None and complete:
        rotating = [f for f in complete if protect is None or f.resolve() != protect.resolve()]
        for folder in rotating[: -max(keep, 1)]:
            shutil.rmtree(folder)
            removed.append(folder)
    if complete:
        newest = step_of(complete[-1])
        for folder in incomplete:
            if step_of(folder) < newest:
                shutil.rmtree(folder)
                removed.append(folder)
    if removed:
        blocks.collect_garbage(run_dir / "checkpoints")
    return removed


def save_pretrained_atomically(model, tokenizer, folder: Path, state_dict=None) -> None:
    """Write a loadable model/adapter + tokenizer via a staging folder, then rename.

    `state_dict`: the weights to write when the live model's own are sharded or split
    (FSDP2, tensor or pipeline parallel), gathered by the caller.
    """
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
