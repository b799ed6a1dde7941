"""torchrun as swiftlm's launcher runs it: `python -m swiftlm.distributed.torchrun <torchrun
arguments>` is `torchrun <torchrun arguments>`, except when workers fail. Then, instead of
torchrun's stack of ChildFailedError frames, the user reads the first failing rank's error
once (see failures.py for how workers record it), which rank it was, and this process exits
with that rank's exit code.
"""

import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

from swiftlm.distributed.failures import FAILURE_DIR_ENV, Failure, read_failures
from swiftlm.distributed.signals import (
    PREEMPTED_EXIT_CODE,
    agent_grace,
    agent_signals,
    stop_agent_once,
)

# torchrun's log lines (their format strings) that the notices below replace.
SIGTERM_SENT = "Sending process %s closing signal %s"
WORKER_FAILED = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
NODES_JOINED = "[%s] Detected %s new nodes from group_rank=%s; will restart worker group"


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    # SIGTERM and SIGUSR1 go on to the workers, who get time to save (`signals`)
    args.signals_to_handle = agent_signals(args.signals_to_handle)
    args.shutdown_timeout = agent_grace(args.shutdown_timeout)
    stop_agent_once()
    command = " ".join(["swiftlm", *args.training_script_args[:1]])  # "swiftlm sft"
    notices = WorkerExitNotices(command, args.max_restarts)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(notices)
    agent_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    agent_log.addFilter(MembershipNotices(command, shown=agent_log.getEffectiveLevel()))
    agent_log.setLevel(min(agent_log.getEffectiveLevel(), logging.INFO))  # to see joins
    with tempfile.TemporaryDirectory(prefix="swiftlm-failures-") as folder:
        os.environ[FAILURE_DIR_ENV] = folder  # the workers inherit it
        try:
            run(args)
        except ChildFailedError as exc:
            return report_child_failure(command, exc, Path(folder))
        except SignalException as exc:  # this launcher was stopped (Ctrl-C, SIGTERM)
            if any(r.exit_code == PREEMPTED_EXIT_CODE for r in read_failures(Path(folder))):
                return PREEMPTED_EXIT_CODE  # the workers saved; rank 0 said where
            return 128 + int(exc.sigval)
    return 0


class WorkerExitNotices(logging.Filter):
    """torchrun's log of worker exits, said once and plainly.

    Dropped: the SIGTERM torchrun sends to each remaining worker, and the failure of its last
    attempt (report_child_failure says it). A failure that torchrun restarts after
    (--max_restarts) becomes one line. On several nodes an agent also restarts for failures
    elsewhere, so a node may announce a restart that does not come; its report still follows.
    Lines of another format pass unchanged.
    """

    def __init__(self, command: str, max_restarts: int):
        super().__init__()
        self.command, self.max_restarts, self.restarts = command, max_restarts, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == SIGTERM_SENT:
            return False
        if record.msg != WORKER_FAILED:
            return True
        if self.restarts < self.max_restarts:
            self.restarts += 1
            exitcode, local_rank = int(record.args[0]), record.args[1]
            print(
                f"{self.command}: local rank {local_rank} failed ({exit_description(exitcode)}); "
                f"restarting the workers (restart {self.restarts} of {self.max_restarts})",
                file=sys.stderr,
                flush=True,
            )
        return False


class MembershipNotices(logging.Filter):
    """An elastic job's agent restarting its workers because nodes joined, said in one line
    (torchrun logs it at INFO, below what it shows). Other lines pass as torchrun's level
    (`shown`) would let them."""

    def __init__(self, command: str, shown: int):
        super().__init__()
        self.command, self.shown = command, shown

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == NODES_JOINED:
            print(
                f"{self.command}: {record.args[1]} node(s) joined; restarting the workers at the "
                "new world size (they resume from the newest checkpoint)",
                file=sys.stderr,
                flush=True,
            )
            return False
        return record.levelno >= self.shown


def report_child_failure(command: str, exc, folder: Path) -> int:
    """Print the first failure of torchrun's last attempt; return its exit code."""
    failed_pids = {failure.pid for failure in exc.failures.values()}
    records = [r for r in read_failures(folder) if r.pid in failed_pids]  # the last attempt
    if records:
        return report_record(command, records)
    rank, failure = exc.get_first_failure()
    print(
        f"{command}: stopped: rank {rank} failed first ({exit_description(failure.exitcode)}); "
        "its output is above",
        file=sys.stderr,
    )
    return shell_exit_code(failure.exitcode)


def report_record(command: str, records: list[Failure]) -> int:
    first = records[0]
    if first.exit_code == PREEMPTED_EXIT_CODE:  # a signal to the workers: they saved and
        return first.exit_code  # stopped, and rank 0 said where the checkpoint is
    if not first.printed:
        print(first.text, file=sys.stderr)
    line = f"{command}: stopped: rank {first.rank} failed first (exit code {first.exit_code})"
    if first.printed:  # a crash: its traceback, prefixed [rank N], is above
        line += f" with {first.text}"
    same = [r.rank for r in records[1:] if r.text == first.text]
    if same:
        ranks = ", ".join(map(str, same))
        line += f"; the same error on rank{'s' if len(same) > 1 else ''} {ranks}"
    print(line, file=sys.stderr)
    return first.exit_code


def exit_description(exitcode: int) -> str:
    """How a worker ended, as a shell user reads it: `exit code 1`, or for a process killed by
    a signal `killed by SIGKILL, exit code 137`."""
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    return f"killed by {name}, exit code {shell_exit_code(exitcode)}"


def shell_exit_code(exitcode: int) -> int:
    """A process killed by signal N reports -N; a shell shows it as 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
