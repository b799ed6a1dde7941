"""Hang detection across ranks (`--heartbeat_timeout`).

Every rank publishes its progress (the loop's last `beat(step, phase)`) to a small file,
`<run_dir>/.heartbeat/rank-N.json`, about once a second; every rank's watchdog reads all the
files and, when any rank has made no progress for longer than the timeout, prints which rank
stalled, at which step and phase, and ends its own process. Each rank watches itself too, so
every rank exits even when it cannot see the others' files (a run directory that is not shared).

Why files, not a collective: a stuck rank blocks every collective, including one that would
report it. Why `os._exit`: the main thread may be blocked inside a C++ collective, where neither
an exception nor a signal handler would ever run.

Only durations cross machines (a rank writes how old its beat is; the reader adds how long ago
it saw that write on its own monotonic clock), so clock skew between nodes does not matter.
"""

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# EX_TEMPFAIL: a temporary failure; torchrun --max_restarts may retry the job.
HEARTBEAT_EXIT_CODE = 75
FOLDER = ".heartbeat"
# Files rewritten every interval; one unchanged for this many intervals belongs to a process
# that died or is frozen (a thread holding the GIL stops the writer too).
STALE_WRITE_INTERVALS = 5
# Which stalled rank to blame first: waiting ranks are usually victims of the one that is not.
ACTIVITY_ORDER = {"running": 0, "backward": 1, "collective": 2}


def heartbeat_dir(run_dir) -> Path:
    return Path(run_dir) / FOLDER


def rank_file(run_dir, rank: int) -> Path:
    return heartbeat_dir(run_dir) / f"rank-{rank}.json"


def write_atomically(path: Path, record: dict) -> None:
    # A reader never sees half a file: the rename replaces the old one in one step.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(tmp, path)


def read_records(run_dir, world_size: int) -> dict[int, dict]:
    """The records present now, by rank; a missing or unreadable file is left out."""
    records = {}
    for rank in range(world_size):
        try:
            records[rank] = json.loads(rank_file(run_dir, rank).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
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


@dataclass
class RankView:
    """What one watchdog knows about one rank, timed on the watchdog's own clock."""

    record: dict
    written_at: float  # when this watchdog first saw the record's current write
    live: bool = False  # the file changed while watched: not a leftover of an earlier run

    def age(self, now: float) -> float:
        """Seconds since the rank's last beat."""
        return now - self.written_at + float(self.record.get("age_s", 0.0))

    def write_key(self) -> tuple:
        return self.record.get("pid"), self.record.get("wrote")

    def suspicion(self, now: float) -> tuple:
        """Sort key: the rank furthest behind, then not waiting on others, then the oldest."""
        activity = ACTIVITY_ORDER.get(self.record.get("activity"), 0)
        return self.record.get("seq", 0), activity, -self.age(now)


def update_views(views: dict[int, RankView], records: dict[int, dict], now: float) -> None:
    """Fold freshly read records into the views (in place)."""
    for rank in list(views):
        if rank not in records and views[rank].live:
            del views[rank]  # it removed its file in stop(): finished, not stuck
    for rank, record in records.items():
        view = views.get(rank)
        if view is None:
            views[rank] = RankView(record, now)
        elif (record.get("pid"), record.get("wrote")) != view.write_key():
            views[rank] = RankView(record, now, live=True)


def find_stall(
    views: dict[int, RankView], now: float, timeout_s: float
) -> tuple[int, RankView] | None:
    """(rank, view) of the rank to blame when any rank has been silent past the timeout."""
    live = {rank: view for rank, view in views.items() if view.live}
    if not any(view.age(now) > timeout_s for view in live.values()):
        return None
    return min(live.items(), key=lambda item: item[1].suspicion(now))


def describe_stall(rank: int, view: RankView, now: float, observer: int, interval_s: float) -> str:
    r = view.record
    silent = now - view.written_at
    if silent > STALE_WRITE_INTERVALS * interval_s:
        state = f"its heartbeat file stopped updating {silent:.1f} s ago: the process died or froze"
    else:
        waiting = " (waiting in a collective)" if r.get("activity") == "collective" else ""
        state = f"now at {r.get('where', 'unknown')}{waiting}"
    return (
        f"swiftlm: rank {rank} made no progress for {view.age(now):.1f} s "
        f"(last: step {r.get('step')}, phase {r.get('phase')}; {state}); stopping all ranks "
        f"(watchdog of rank {observer}). If that phase legitimately takes longer, raise "
        "--heartbeat_timeout (0 disables the watchdog).\n"
    )


def _report_to_stderr(message: str) -> None:
    # os.write, not print: sys.stderr's lock may be held by the blocked main thread.
    os.write(2, message.encode("utf-8", "replace"))


class Heartbeat:
    """Records progress; `beat(step, phase)` is called by the loop at every phase change.

    `start()` launches a daemon thread that, every `interval_s`, writes this rank's record and
    checks every rank's; a stall ends the process with HEARTBEAT_EXIT_CODE. A `timeout_s` of 0
    disables it all. `clock`, `exit_fn` and `report` are injectable for tests.
    """

    def __init__(
        self,
        ctx,
        timeout_s: float,
        run_dir,
        *,
        interval_s: float = 1.0,
        clock=time.monotonic,
        exit_fn=os._exit,
        report=_report_to_stderr,
    ):
        self.ctx, self.timeout_s, self.run_dir = ctx, timeout_s, run_dir
        self.interval_s, self.clock, self.exit_fn, self.report = interval_s, clock, exit_fn, report
        self.views: dict[int, RankView] = {}
        self._last = (0, 0, "setup", clock())  # (seq, step, phase, time); one tuple: atomic
        self._wrote = 0
        self._main_ident: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def start(self) -> None:
        if not self.enabled:
            return
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
        try:
            heartbeat_dir(self.run_dir).rmdir()  # the last rank to stop removes the folder
        except OSError:
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def tick(self) -> str | None:
        """Publish this rank's record, check all ranks; return the stall message, if any."""
        now = self.clock()
        try:
            write_atomically(rank_file(self.run_dir, self.ctx.rank), self._record(now))
            update_views(self.views, read_records(self.run_dir, self.ctx.world_size), now)
        except OSError as exc:  # a full or flaky disk must not kill training; the next tick retries
            self.report(f"swiftlm: heartbeat of rank {self.ctx.rank} cannot use {exc}\n")
            return None
        stall = find_stall(self.views, now, self.timeout_s)
        if stall is None:
            return None
        message = describe_stall(*stall, now, self.ctx.rank, self.interval_s)
        self.report(message)
        self.exit_fn(HEARTBEAT_EXIT_CODE)
        return message

    def _record(self, now: float) -> dict:
        seq, step, phase, at = self._last
        where, activity = locate_thread(self._main_ident)
        self._wrote += 1
        return {
            "rank": self.ctx.rank,
            "pid": os.getpid(),
            "wrote": self._wrote,
            "seq": seq,
            "step": step,
            "phase": phase,
            "age_s": round(now - at, 3),
            "where": where,
            "activity": activity,
        }
