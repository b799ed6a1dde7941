"""Hang detection (`--heartbeat_timeout`), in one process and across ranks.

Each rank's loop calls `beat(step, phase)` at every phase change. A watchdog thread per rank
writes that last beat to `<run_dir>/.heartbeat/rank-N.json` about once a second, and when its
own rank has made no progress for longer than the timeout it writes the Python stack of every
thread of its process to `<run_dir>/hang/rank-N-stacks.txt`, reads every rank's file, prints
which rank stalled (at which step and phase, where its main thread is, which stack file to
read), and ends its process with HEARTBEAT_EXIT_CODE. A single process is a world of one: the
same watchdog, and the message speaks of the process instead of ranks.

- Every rank only needs to watch itself: training runs collectives every step, so when one
  rank is stuck or dead, every other rank stops at its next collective and times out too.
  Normal operation therefore costs one small write per rank per second, no reads.
- The blamed rank is not simply the one with the oldest beat: ranks waiting for a stuck rank
  beat at the same moment it did. It is the rank furthest behind in the loop, then the one
  whose main thread is not waiting inside torch.distributed/autograd, then the oldest.
- Every rank dumps its own stacks, the stuck one included (its watchdog fires too: it made no
  progress either); each rank's message names the blamed rank's file. Stacks are written
  twice: formatted from `sys._current_frames()` with thread names, then by `faulthandler`,
  the interpreter's own view, which needs no Python-level locks.
- Why files, not a collective: a stuck rank blocks every collective, including one that would
  report it. Why `os._exit`: the main thread may be blocked inside a C++ collective, where
  neither an exception nor a signal handler would ever run.
"""

import contextlib
import faulthandler
import json
import os
import secrets
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

# EX_TEMPFAIL, a temporary failure: torchrun --max_restarts restarts the workers.
HEARTBEAT_EXIT_CODE = 75
FOLDER = ".heartbeat"
HANG_FOLDER = "hang"  # the stack dumps: kept after the run, unlike FOLDER
# A file rewritten every interval but unchanged for this many belongs to a process that died
# or froze (a C call holding the GIL stops the writer thread too).
STALE_WRITE_INTERVALS = 5
# Which of the ranks at the same point of the loop to blame first: waiting ones are victims.
ACTIVITY_ORDER = {"running": 0, "backward": 1, "collective": 2}


def heartbeat_dir(run_dir) -> Path:
    return Path(run_dir) / FOLDER


def rank_file(run_dir, rank: int) -> Path:
    return heartbeat_dir(run_dir) / f"rank-{rank}.json"


def stacks_file(run_dir, rank: int) -> Path:
    return Path(run_dir) / HANG_FOLDER / f"rank-{rank}-stacks.txt"


def write_atomically(path: Path, record: dict) -> None:
    # A reader never sees half a file: the rename replaces the old one in one step.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(tmp, path)


def read_records(run_dir, world_size: int, token: str) -> dict[int, dict]:
    """This run's records by rank; missing, unreadable and leftover files are left out."""
    records = {}
    for rank in range(world_size):
        try:
            record = json.loads(rank_file(run_dir, rank).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if record.get("token") == token:  # not a leftover of an earlier attempt or job
            records[rank] = record
    return records


def classify(filename: str) -> str:
    """What a thread is doing, judged by the file of its innermost Python frame."""
    path = filename.replace("\\", "/")
    if "/torch/distributed/" in path or "/torch/nn/parallel/" in path:
        return "collective"
    if "/torch/autograd/" in path:  # DDP's all-reduce runs (and waits) inside backward
        return "backward"
    return "running"


def short_path(filename: str) -> str:
    path = filename.replace("\\", "/")
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    return "/".join(path.rsplit("/", 2)[-2:])


def locate_thread(ident: int | None) -> tuple[str, str]:
    """(`file:line in function`, activity) of a thread's innermost Python frame."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return "unknown", "running"
    code = frame.f_code
    where = f"{short_path(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
    return where, classify(code.co_filename)


@dataclass(frozen=True)
class RankState:
    """One rank's last record, with how long ago (on the reader's clock) it was written."""

    record: dict
    silent_s: float  # since the file was last written

    @property
    def age_s(self) -> float:
        """Seconds since the rank's last beat."""
        return self.silent_s + float(self.record.get("age_s", 0.0))

    def suspicion(self) -> tuple:
        """Sort key, most suspect first: furthest behind, not waiting on others, oldest."""
        activity = ACTIVITY_ORDER.get(self.record.get("activity"), 0)
        return self.record.get("seq", 0), activity, -self.age_s


def rank_states(records: dict[int, dict], wall_now: float) -> dict[int, RankState]:
    # Wall clocks of different nodes are compared here, so skew only blurs the reported ages;
    # whether to stop is decided on this rank's own monotonic clock.
    return {
        rank: RankState(record, max(0.0, wall_now - float(record.get("written", wall_now))))
        for rank, record in records.items()
    }


def pick_culprit(states: dict[int, RankState]) -> int:
    return min(states, key=lambda rank: states[rank].suspicion())


def describe_stall(rank: int, state: RankState, observer: int, interval_s: float) -> str:
    """The sentence that names the stalled rank, its step and phase, and where it is now."""
    r = state.record
    return (
        f"swiftlm: rank {rank} made no progress for {state.age_s:.1f} s "
        f"(last: step {r.get('step')}, phase {r.get('phase')}; {_now(state, interval_s)}); "
        f"stopping all ranks (watchdog of rank {observer}). {RAISE_TIMEOUT}\n"
    )


def describe_single_stall(state: RankState, interval_s: float) -> str:
    """The same for a process alone: no ranks to speak of."""
    r = state.record
    return (
        f"swiftlm: no training progress for {state.age_s:.1f} s (last: step {r.get('step')}, "
        f"phase {r.get('phase')}; main thread {_now(state, interval_s)}); stopping. "
        f"{RAISE_TIMEOUT}\n"
    )


RAISE_TIMEOUT = (
    "If that phase legitimately takes longer, raise --heartbeat_timeout (0 disables the watchdog)."
)


def _now(state: RankState, interval_s: float) -> str:
    r = state.record
    if state.silent_s > STALE_WRITE_INTERVALS * interval_s:
        return f"its heartbeat stopped {state.silent_s:.1f} s ago: the process died or froze"
    waiting = " (waiting in a collective)" if r.get("activity") == "collective" else ""
    return f"now at {r.get('where', 'unknown')}{waiting}"


def describe_stacks(
    run_dir, culprit: int, observer: int, world_size: int, written: Path | None
) -> str:
    """Which file holds whose stacks: the blamed rank writes its own (if it is still alive)."""
    if world_size == 1:
        where = written or "they could not be written (see above)"
        return f"Python stacks of every thread: {where}\n"
    if written is None:
        own = f"rank {observer}'s could not be written (see above)"
    else:
        own = f"rank {observer}'s in {written}"
    if culprit == observer:
        return f"Python stacks of every thread: {own}.\n"
    return (
        f"Python stacks of every thread: rank {culprit}'s in {stacks_file(run_dir, culprit)} "
        f"(written by its own watchdog, if the process is alive), {own}.\n"
    )


def format_thread_stacks(main_ident: int | None) -> str:
    """Every thread's Python stack, the training loop's first, each titled with its name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    order = sorted(frames, key=lambda ident: ident != main_ident)
    parts = []
    for ident in order:
        role = ""
        if ident == main_ident:
            role = " - the training loop"
        elif ident == threading.get_ident():
            role = " - this watchdog"
        title = f'Thread "{names.get(ident, "?")}" (id {ident}){role}, most recent call last:\n'
        parts.append(title + "".join(traceback.format_stack(frames[ident])))
    return "\n".join(parts)


def dump_stacks(path: Path, main_ident: int | None, header: str) -> None:
    """Write every thread's stack to `path`: formatted, then as faulthandler sees them.

    faulthandler goes last because it writes to the file descriptor directly; it also works
    when formatting does not (e.g. a frame whose source cannot be read).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        f.write(header + "\n")
        try:
            f.write(format_thread_stacks(main_ident))
        except Exception as exc:  # noqa: BLE001 - the faulthandler part below still helps
            f.write(f"(formatting the stacks failed: {exc!r})\n")
        f.write("\n--- faulthandler: the same threads, as the interpreter sees them ---\n")
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)


def _report_to_stderr(message: str) -> None:
    # os.write, not print: sys.stderr's lock may be held by the blocked main thread.
    os.write(2, message.encode("utf-8", "replace"))


class Heartbeat:
    """Records progress; `beat(step, phase)` is called by the loop at every phase change. The
    same in a single process (a world of one: `broadcast_object` needs no process group) as on
    every rank of a job.

    `start()` (on every rank at the same point: it broadcasts a run token) launches the
    watchdog thread; `stop()` ends it and removes this rank's file. A `timeout_s` of 0 disables
    everything. The clocks, `exit_fn` and `report` are injectable for tests.
    """

    def __init__(
        self,
        ctx,
        timeout_s: float,
        run_dir,
        *,
        interval_s: float = 1.0,
        clock=time.monotonic,
        wall=time.time,
        exit_fn=os._exit,
        report=_report_to_stderr,
    ):
        self.ctx, self.timeout_s, self.run_dir = ctx, timeout_s, run_dir
        self.interval_s, self.clock, self.wall = interval_s, clock, wall
        self.exit_fn, self.report = exit_fn, report
        self.token = ""
        self._last = (0, 0, "setup", clock())  # (seq, step, phase, time); one tuple: atomic
        self._main_ident: int | None = None
        self._write_failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def start(self) -> None:
        if not self.enabled:
            return
        self.token = self.ctx.broadcast_object(secrets.token_hex(8))
        self._main_ident = threading.get_ident()  # the thread that runs the loop
        self.beat(0, "setup")
        self.tick()  # the file exists before the first step
        self._thread = threading.Thread(target=self._run, name="swiftlm-heartbeat", daemon=True)
        self._thread.start()

    def beat(self, step: int, phase: str) -> None:
        if self.enabled:
            self._last = (self._last[0] + 1, step, phase, self.clock())

    def stop(self) -> None:
        if not self.enabled:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s)
        rank_file(self.run_dir, self.ctx.rank).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: another rank is still running
            heartbeat_dir(self.run_dir).rmdir()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def tick(self) -> str | None:
        """Publish this rank's beat; past the timeout, blame a rank and stop the process."""
        record = self._record()
        self._publish(record)
        if self.clock() - self._last[3] <= self.timeout_s:
            return None
        written = self._dump_stacks(record)
        message = self._describe(record, written)
        self.report(message)
        self.exit_fn(HEARTBEAT_EXIT_CODE)
        return message

    def _describe(self, record: dict, written: Path | None) -> str:
        """The stop message: which rank stalled (alone: the process), and where the stacks are."""
        rank = self.ctx.rank
        if self.ctx.world_size == 1:
            state = rank_states({rank: record}, record["written"])[rank]
            stall = describe_single_stall(state, self.interval_s)
            return stall + describe_stacks(self.run_dir, rank, rank, 1, written)
        records = read_records(self.run_dir, self.ctx.world_size, self.token)
        states = rank_states({**records, rank: record}, record["written"])
        culprit = pick_culprit(states)
        stall = describe_stall(culprit, states[culprit], rank, self.interval_s)
        return stall + describe_stacks(self.run_dir, culprit, rank, self.ctx.world_size, written)

    def _dump_stacks(self, record: dict) -> Path | None:
        """This process's stacks to hang/rank-N-stacks.txt; to stderr if that cannot be written."""
        path = stacks_file(self.run_dir, self.ctx.rank)
        header = (
            f"swiftlm watchdog of rank {self.ctx.rank} (pid {os.getpid()}): no progress for "
            f"{record['age_s']:.1f} s (last: step {record['step']}, phase {record['phase']}; "
            f"main thread at {record['where']}), {time.strftime('%Y-%m-%d %H:%M:%S')}"
        )
        try:
            dump_stacks(path, self._main_ident, header)
        except OSError as exc:  # a full disk: the stacks still matter, stderr has them
            self.report(f"swiftlm: cannot write the stacks to {path} ({exc}); on stderr:\n")
            faulthandler.dump_traceback(2, all_threads=True)  # fd 2: stderr
            return None
        return path

    def _publish(self, record: dict) -> None:
        try:
            write_atomically(rank_file(self.run_dir, self.ctx.rank), record)
        except OSError as exc:  # a full or flaky disk must not stop training; retried next tick
            if not self._write_failed:
                self.report(f"swiftlm: rank {self.ctx.rank} cannot write its heartbeat: {exc}\n")
            self._write_failed = True

    def _record(self) -> dict:
        seq, step, phase, at = self._last
        where, activity = locate_thread(self._main_ident)
        return {
            "token": self.token,
            "rank": self.ctx.rank,
            "seq": seq,
            "step": step,
            "phase": phase,
            "age_s": round(self.clock() - at, 3),
            "written": self.wall(),
            "where": where,
            "activity": activity,
        }
