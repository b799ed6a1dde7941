"""Preemption: SIGTERM or SIGUSR1 saves a checkpoint at the next step boundary, then the run
stops with `Preempted.exit_code` (99), a status a scheduler can requeue on.

Schedulers warn before they kill: Kubernetes sends SIGTERM and kills after the pod's grace
period, SLURM sends SIGUSR1 (`--signal=USR1@120`) or SIGTERM before the time limit. The
handler only records the signal; the loop asks `stop_requested` after each optimizer step,
where the model, optimizer and data position agree. With several ranks one may be signalled
and another not (SLURM signals every process, a user may signal one), so the ranks agree
through one all-reduce of a small integer per step (the largest signal number received
anywhere: SIGTERM wins over SIGUSR1); every rank then saves the same complete checkpoint.

A second signal while saving changes nothing: the handler stays installed until the loop is
left, and `COMPLETE` is written last, so a kill -9 during the save leaves an incomplete
folder that `--resume_from_checkpoint auto` skips.
"""

import signal
import threading

import torch
import torch.distributed as dist

from swiftlm.checkpoint import checkpoint_dir
from swiftlm.distributed.env import collective_device
from swiftlm.errors import Preempted
from swiftlm.train.state import wait_for_background_saves

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatch:
    """`install` before the loop, `restore` after it (in a `finally`)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.received = 0  # the first signal number seen by this process (0: none)
        self._previous: dict[int, object] = {}

    def install(self) -> "PreemptionWatch":
        # Python delivers signals to the main thread only; a loop run from another thread
        # (a notebook's worker) keeps the default handlers.
        if threading.current_thread() is threading.main_thread():
            for sig in PREEMPTION_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame) -> None:
        if not self.received:  # later signals: the save is already on its way
            self.received = signum

    def stop_requested(self) -> int:
        """The signal that stops the run at this step boundary, agreed by every rank (0: go
        on). One process: a local check, no collective."""
        if not self.ctx.distributed:
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int32, device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def stop_if_signalled(self, job, step: int, saved: bool, save) -> None:
        """At a step boundary: if a rank was signalled, every rank saves this step (unless
        `saved` already) and the run stops with `Preempted`. `save` writes the checkpoint."""
        signum = self.stop_requested()
        if not signum:
            return
        if not saved:
            save()
        wait_for_background_saves(job.strategy)  # COMPLETE is on disk before the exit
        folder = checkpoint_dir(job.run_dir, step)
        if job.checkpoint_tiers is not None and job.strategy.ctx.is_main:
            job.checkpoint_tiers.finish(folder)  # --checkpoint_mirror gets it before the exit
        stop = preempted(signum, step, folder)
        job.log(str(stop))
        raise stop


def preempted(signum: int, step: int, folder) -> Preempted:
    """The stop that the CLI turns into the preemption exit status."""
    name = signal.Signals(signum).name
    return Preempted(
        f"preempted by {name} at step {step}: saved checkpoint {folder}; resume with "
        "--resume_from_checkpoint auto",
        signal_name=name,
    )
