"""One clean report when workers fail under swiftlm's launcher.

Under `swiftlm sft --nproc_per_node N`, one bad input used to reach the user several times:
every rank printed the same `error:` line, a rank blocked in a collective added a gloo/NCCL
traceback when its peer exited, and torchrun ended with its stack of ChildFailedError frames.
Now the launcher (distributed/torchrun.py) gives its workers a folder for failure records
(SWIFTLM_FAILURE_DIR), and:

- a worker that stops on a SwiftLMError writes a record (rank, the error text, exit code)
  instead of printing it;
- a worker that crashes prints its traceback and writes a record, unless another rank of the
  same attempt failed before it: its crash is then an echo of that failure (a collective whose
  peer is gone) and it stays silent;
- the launcher prints the first record once, names its rank, and exits with its exit code.

Without swiftlm's launcher (one process, or `torchrun -m swiftlm ...` run by hand) a worker
prints its error as before. No torch import here: the CLI imports this in every process.
"""

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

FAILURE_DIR_ENV = "SWIFTLM_FAILURE_DIR"
ELASTIC_ENV = "SWIFTLM_ELASTIC"  # set by the launcher of an elastic job (--nnodes MIN:MAX)
# How a collective fails when a peer's process is gone (gloo's words; NCCL's watchdog aborts).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


@dataclass(frozen=True)
class Failure:
    rank: int
    pid: int  # matches torchrun's own record of the failed process
    attempt: str  # this set of workers (`current_attempt`): records of earlier ones are history
    time: float
    exit_code: int
    text: str  # what the user is shown: the `swiftlm sft: error: ...` text, or the crash
    printed: bool  # True: the worker printed it already (a crash's traceback)


def failure_dir() -> Path | None:
    """The launcher's record folder, in a worker it started; None anywhere else."""
    folder = os.environ.get(FAILURE_DIR_ENV)
    return Path(folder) if folder and "RANK" in os.environ else None


def report_error(command: str, exc: Exception) -> None:
    """Tell the user about a SwiftLMError: print it, or in a worker of swiftlm's launcher,
    record it for the launcher, which prints the first failing rank's error once."""
    text = f"swiftlm {command}: error: {exc}"
    folder = failure_dir()
    if folder is None:
        print(text, file=sys.stderr)
    else:
        write_failure(folder, text, getattr(exc, "exit_code", 1), printed=False)


def install_crash_hook() -> None:
    """In a worker of swiftlm's launcher, keep quiet a crash that echoes another rank's failure.

    Called once the process group exists (collectives are where echoes come from). The hook
    wraps torch's own, which prefixes each traceback line with the rank.
    """
    folder = failure_dir()
    if folder is None:
        return
    previous = sys.excepthook

    def hook(exc_type, exc, traceback) -> None:
        if read_failures(folder, attempt=current_attempt()):
            return  # another rank failed first; the launcher reports that failure
        summary = f"{exc_type.__name__}: {exc}".splitlines()[0]
        write_failure(folder, summary, 1, printed=True)
        if os.environ.get(ELASTIC_ENV) and any(sign in summary for sign in PEER_LOST):
            # An elastic job lost a node: expected, and its agent restarts the workers.
            print(
                f"[rank {os.environ['RANK']}] a node left the job ({summary[:200]}); the "
                "elastic agent restarts the workers at the new size",
                file=sys.stderr,
                flush=True,
            )
            return
        previous(exc_type, exc, traceback)

    sys.excepthook = hook


def current_attempt() -> str:
    """This set of workers: torchrun's restart count; in an elastic job also the store its
    rank 0 hosts, on a port chosen anew at every membership change, which restarts the
    workers without counting a restart."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get(ELASTIC_ENV):
        attempt += f"-{os.environ.get('MASTER_PORT', '0')}"
    return attempt


def write_failure(folder: Path, text: str, exit_code: int, printed: bool) -> None:
    failure = Failure(
        rank=int(os.environ["RANK"]),
        pid=os.getpid(),
        attempt=current_attempt(),
        time=time.time(),
        exit_code=exit_code,
        text=text,
        printed=printed,
    )
    path = folder / f"attempt-{failure.attempt}-rank-{failure.rank}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(asdict(failure)))
    partial.replace(path)  # whole or absent: another rank may be reading the folder right now


def read_failures(folder: Path, attempt: str | None = None) -> list[Failure]:
    """The records in `folder` (of one attempt, when given), first failure first."""
    failures = [Failure(**json.loads(path.read_text())) for path in folder.glob("*.json")]
    if attempt is not None:
        failures = [f for f in failures if f.attempt == attempt]
    return sorted(failures, key=lambda f: (f.time, f.rank))
