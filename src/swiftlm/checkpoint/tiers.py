"""Checkpoint tiers: the run directory, a fast local tier, and an object-storage mirror.

- run directory (--save_steps): `<run>/checkpoints/step-N`, as always;
- local tier (--local_save_steps): the same folders under --local_save_dir (default
  `/dev/shm/swiftlm/<run name>-<hash of the run path>`), written more often and kept few
  (--local_save_total_limit). A step due for both goes to the run directory only: that copy
  is complete and durable already, and a second write of the same state would only cost time;
- mirror (--checkpoint_mirror): every complete checkpoint of the run directory, copied in
  the background (`mirror.py`).

`--resume_from_checkpoint auto` takes the newest complete checkpoint of all three (a tie goes
to the run directory, then the local tier: no copy needed); a mirrored one is downloaded into
the run directory first. A folder or copy without `COMPLETE` is never resumed from, whichever
tier it is in.
"""

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from swiftlm.checkpoint import blocks
from swiftlm.checkpoint.folders import list_checkpoints, prune_checkpoints, step_of
from swiftlm.checkpoint.mirror import BackgroundMirror, Mirror, parse_options
from swiftlm.errors import CheckpointError, ConfigError

RUN_TIER, LOCAL_TIER, MIRROR_TIER = "run directory", "local tier", "mirror"
SHM = Path("/dev/shm")


@dataclass(frozen=True)
class Found:
    """A complete checkpoint in one tier; `folder`: where it is on this machine (None for a
    mirrored one not yet downloaded)."""

    step: int
    tier: str
    folder: Path | None


def default_local_dir(run_dir: Path, shm: Path = SHM) -> Path:
    """`/dev/shm/swiftlm/<run name>-<hash>`: one folder per run directory, so that runs with
    the same folder name elsewhere do not share it."""
    if not shm.is_dir():
        raise ConfigError(
            f"--local_save_steps: {shm} does not exist on this machine, so the local tier has "
            "no default folder; pass --local_save_dir DIR (fast local storage, e.g. NVMe)"
        )
    digest = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:10]
    return shm / "swiftlm" / f"{run_dir.resolve().name}-{digest}"


def tier_due(output, step: int, last: bool) -> str | None:
    """Where the checkpoint of `step` goes: the run directory (every --save_steps and at the
    end), the local tier (every --local_save_steps otherwise), or nowhere (None)."""
    if step % output.save_steps == 0 or last:
        return RUN_TIER
    local = getattr(output, "local_save_steps", None)
    return LOCAL_TIER if local and step % local == 0 else None


class Tiers:
    """The local tier and the mirror of one run (either may be absent)."""

    def __init__(self, output, run_dir: Path, rank: int, log):
        self.output, self.run_dir, self.log = output, run_dir, log
        self.local_dir = None
        if output.local_save_steps:
            given = output.local_save_dir
            self.local_dir = Path(given).expanduser() if given else default_local_dir(run_dir)
        self.mirror = None
        if output.checkpoint_mirror:
            options = parse_options(output.checkpoint_mirror_options)
            self.mirror = Mirror(output.checkpoint_mirror, options)
            self.mirror.probe(rank)  # before anything trains: a clear error, not a warning
        self.uploader = None

    @classmethod
    def of(cls, output, run_dir: Path, rank: int, log) -> "Tiers | None":
        if not (output.local_save_steps or output.checkpoint_mirror):
            return None
        return cls(output, run_dir, rank, log)

    def newest(self) -> tuple[Found | None, list[Path | str]]:
        """The newest complete checkpoint across tiers, and the incomplete ones newer than it
        (skipped: interrupted while written or copied)."""
        found, incomplete = _in_folder(self.run_dir, RUN_TIER)
        if self.local_dir is not None:
            local, torn = _in_folder(self.local_dir, LOCAL_TIER)
            found, incomplete = found + local, incomplete + torn
        if self.mirror is not None:
            complete, torn = self.mirror.steps()
            found += [Found(step, MIRROR_TIER, None) for step in complete]
            incomplete += [(step, self.mirror.url_of(step)) for step in torn]
        order = {RUN_TIER: 2, LOCAL_TIER: 1, MIRROR_TIER: 0}
        best = max(found, key=lambda f: (f.step, order[f.tier]), default=None)
        skipped = [where for step, where in incomplete if best is None or step > best.step]
        return best, skipped

    def fetch(self, found: Found) -> Path:
        """A local folder of `found`: a mirrored checkpoint is downloaded into the run dir."""
        if found.folder is not None:
            return found.folder
        return self.mirror.download(found.step, self.run_dir)

    def start_fresh(self, start_step: int) -> None:
        """Drop local-tier checkpoints after the step this run starts from (those of an earlier
        run in the same folder, which `auto` would otherwise pick), and refuse to start a new
        run over a mirror that holds another run's checkpoints. Rank 0."""
        if self.local_dir is not None:
            complete, incomplete = list_checkpoints(self.local_dir)
            for folder in complete + incomplete:
                if step_of(folder) > start_step:
                    shutil.rmtree(folder)
                    self.log(f"removed {folder} from the local tier (not of this run)")
        if self.mirror is not None and start_step == 0:
            complete, _ = self.mirror.steps()
            if complete:
                raise ConfigError(
                    f"--checkpoint_mirror {self.mirror.url} holds checkpoints of a run (steps "
                    f"{', '.join(map(str, complete))}) and this run starts from scratch: "
                    "continue that run with --resume_from_checkpoint auto, or give this run "
                    "its own mirror URL"
                )

    def saved(self, tier: str, folder: Path, protect_step: int | None) -> None:
        """After a checkpoint is written (rank 0): prune the local tier, copy to the mirror."""
        if tier == LOCAL_TIER:
            removed = prune_checkpoints(self.local_dir, self.output.local_save_total_limit)
            for folder in removed:
                self.log(f"removed old local checkpoint {folder}")
            if removed:  # blocks of incremental checkpoints no folder there needs any more
                blocks.collect_garbage(self.local_dir / "checkpoints")
        elif self.mirror is not None:
            if self.uploader is None:
                keep = self.output.save_total_limit
                self.uploader = BackgroundMirror(self.mirror, self.run_dir, keep, self.log)
            self.uploader.notify(protect_step)

    def finish(self, newest: Path) -> None:
        """End of training: wait for the last copy to the mirror."""
        if self.uploader is not None:
            self.uploader.finish(newest)
            self.uploader = None

    def folder(self, tier: str, step: int) -> Path:
        root = self.local_dir if tier == LOCAL_TIER else self.run_dir
        return root / "checkpoints" / f"step-{step}"


def _in_folder(root: Path, tier: str) -> tuple[list[Found], list[tuple[int, Path]]]:
    complete, incomplete = list_checkpoints(root)
    return (
        [Found(step_of(f), tier, f) for f in complete],
        [(step_of(f), f) for f in incomplete],
    )


def mirror_of_url(spec: str, options: str | None) -> tuple[Mirror, int]:
    """--resume_from_checkpoint <url>/checkpoints/step-N: the mirror and the step."""
    base, _, name = spec.rstrip("/").rpartition("/")
    root, _, checkpoints = base.rpartition("/")
    if checkpoints != "checkpoints" or not name.startswith("step-") or not name[5:].isdigit():
        raise ConfigError(
            f"--resume_from_checkpoint {spec}: a mirrored checkpoint's URL ends in "
            "/checkpoints/step-N (e.g. s3://bucket/run/checkpoints/step-100); or use "
            "--resume_from_checkpoint auto with --checkpoint_mirror s3://bucket/run"
        )
    return Mirror(root, parse_options(options)), int(name[5:])


def fetch_url(spec: str, options: str | None, run_dir: Path) -> Path:
    """Download the mirrored checkpoint `spec` into the run directory (rank 0)."""
    mirror, step = mirror_of_url(spec, options)
    complete, incomplete = mirror.steps()
    if step not in complete:
        state = (
            "is incomplete (no COMPLETE: its copy was cut short)"
            if step in incomplete
            else ("does not exist")
        )
        newest = f"; the newest complete one there is step-{complete[-1]}" if complete else ""
        raise CheckpointError(f"--resume_from_checkpoint {spec} {state}{newest}")
    return mirror.download(step, run_dir)
