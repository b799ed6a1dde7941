"""`--profile`: a PyTorch profiler trace of a window of optimizer steps (`--profile_steps`).

The loop calls `step_begin(step)` / `step_end(step)` around every optimizer step and `close()`
in a `finally`. Without `--profile` these return at once and torch.profiler is never imported.
With it, the profiler runs from `step_begin(first)` to `step_end(last)` (started and stopped
by hand, so the trace covers exactly those steps, each marked `swiftlm step N`) and writes to
`<run_dir>/profile/`:

- `trace.json`: a Chrome/Perfetto trace (https://ui.perfetto.dev or chrome://tracing), CPU
  operators with shapes and memory, plus CUDA kernels on a GPU. Python stacks are off: they
  multiply the profiler's overhead and the trace size.
- `top_operators.txt`: the operator table sorted by self CPU time (and by self CUDA time on a
  GPU); the top ~10 are also logged.
- on CUDA, `memory_snapshot.pickle`: the allocator's history over the window
  (`torch.cuda.memory._record_memory_history`), for https://pytorch.org/memory_viz.

A window past the run's last step is clamped to it, and a run resumed past the window
profiles nothing; both are said in one log line, never silently. In a distributed run rank 0
writes the names above and rank N adds `-rank-N` (`trace-rank-1.json`).
"""

from pathlib import Path

import torch

from swiftlm.monitor.config import parse_step_range
from swiftlm.monitor.oom import oom_history_on, start_oom_history

PROFILE_FOLDER = "profile"
TABLE_ROWS = 15
LOGGED_ROWS = 10
# Allocation events kept over the profiled window (ring buffer, a few KB each with stacks).
PROFILE_HISTORY_ENTRIES = 100_000
PERFETTO = "https://ui.perfetto.dev"
MEMORY_VIZ = "https://pytorch.org/memory_viz"


def plan_window(first: int, last: int, num_steps: int) -> tuple[tuple[int, int] | None, str]:
    """(the steps to profile, or None; a note for the log when they differ from the flag's)."""
    flag = f"--profile_steps {first}-{last}"
    if num_steps < 1:
        return None, f"{flag}: the run has no steps to profile"
    if last <= num_steps:
        return (first, last), ""
    window = (min(first, num_steps), num_steps)
    return window, f"{flag}: the run has {num_steps} steps; profiling steps {window[0]}-{window[1]}"


class StepProfiler:
    """Profiles the optimizer steps of `--profile_steps`; every method is a no-op without
    `--profile`. `close()` is idempotent: a run stopped inside the window still gets the
    trace of the steps it made."""

    def __init__(self, monitor_args, run_dir: Path, device: torch.device, log, num_steps: int):
        self.device, self.log = device, log
        self.folder = Path(run_dir) / PROFILE_FOLDER
        self.window: tuple[int, int] | None = None
        self._prof = None  # the running torch.profiler.profile
        self._range = None  # the open `swiftlm step N` annotation
        self._first_done = 0  # first step inside the window (a resumed run may start late)
        self._last_begun = 0
        self._done = not monitor_args.profile
        if self._done:
            return
        first, last = parse_step_range(monitor_args.profile_steps)
        self.window, note = plan_window(first, last, num_steps)
        self._done = self.window is None
        if note:
            log(note)

    @property
    def active(self) -> bool:
        return self._prof is not None

    def step_begin(self, step: int) -> None:
        """At the start of optimizer step `step` (1-based)."""
        if self._done:
            return
        if self._prof is None and not self._should_start(step):
            return
        self._last_begun = step
        self._range = torch.profiler.record_function(f"swiftlm step {step}")
        self._range.__enter__()

    def step_end(self, step: int) -> None:
        """After optimizer step `step`: closes its annotation; at the window's end, writes."""
        if self._prof is None:
            return
        self._close_range()
        if step >= self.window[1]:
            self._finish(step)

    def close(self) -> None:
        """Stop a profile still running (the run ended or failed inside the window)."""
        if self._prof is not None:
            self._close_range()
            self._finish(self._last_begun)
        self._done = True

    def _should_start(self, step: int) -> bool:
        first, last = self.window
        if step < first:
            return False
        if step > last:  # a resumed run that is already past the window
            self.log(f"--profile_steps {first}-{last}: resumed at step {step}, no profile")
            self._done = True
            return False
        if step > first:
            self.log(
                f"--profile_steps {first}-{last}: resumed at step {step}; profiling {step}-{last}"
            )
        return self._start(step)

    def _start(self, step: int) -> bool:
        from torch.profiler import profile  # only ever paid with --profile

        prof = profile(
            activities=_profiler_activities(self.device),
            record_shapes=True,
            profile_memory=True,
            with_stack=False,
        )
        try:
            prof.start()
        except RuntimeError as exc:  # e.g. another profiler is already running
            self.log(f"--profile: the profiler could not start ({exc}); training goes on")
            self._done = True
            return False
        if self.device.type == "cuda":
            try:
                torch.cuda.memory._record_memory_history(
                    max_entries=PROFILE_HISTORY_ENTRIES, stacks="python"
                )
            except (RuntimeError, TypeError) as exc:  # the trace is still worth having
                self.log(f"--profile: no memory history ({exc})")
        self._prof, self._first_done = prof, step
        return True

    def _close_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def _finish(self, step: int) -> None:
        """Stop, then write the memory snapshot (CUDA), the trace and the operator table."""
        prof, self._prof, self._done = self._prof, None, True
        on_cuda = self.device.type == "cuda"
        try:
            if on_cuda:
                torch.cuda.synchronize(self.device)  # the last step's kernels in the trace
            prof.stop()
            self.folder.mkdir(parents=True, exist_ok=True)
            # The snapshot first: it is the window's end state, before the export allocates.
            snapshot = self._dump_memory() if on_cuda else None
            trace = self.folder / file_name("trace", ".json")
            prof.export_chrome_trace(str(trace))
            averages = prof.key_averages()
            table = self.folder / file_name("top_operators", ".txt")
            table.write_text(operator_tables(averages, on_cuda), encoding="utf-8")
            events = operator_events(averages)
            self.log(describe_profile(f"{self._first_done}-{step}", trace, table, events, on_cuda))
            if snapshot:
                self.log(f"memory snapshot: {snapshot} (drag it onto {MEMORY_VIZ})")
        except Exception as exc:  # noqa: BLE001 - a failed export must not end the training
            self.log(f"--profile: could not write the profile to {self.folder}: {exc}")
        finally:
            self._restore_memory_history()

    def _dump_memory(self) -> Path:
        path = self.folder / file_name("memory_snapshot", ".pickle")
        torch.cuda.memory._dump_snapshot(str(path))
        return path

    def _restore_memory_history(self) -> None:
        """Back to the out-of-memory history if it was on, else off."""
        if self.device.type != "cuda":
            return
        if oom_history_on():
            start_oom_history(self.device)
        else:
            torch.cuda.memory._record_memory_history(enabled=None)


def _profiler_activities(device: torch.device) -> list:
    from torch.profiler import ProfilerActivity

    if device.type == "cuda":
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    return [ProfilerActivity.CPU]


def file_name(stem: str, suffix: str) -> str:
    """`trace.json` on rank 0 (or alone), `trace-rank-N.json` on rank N."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() > 0:
        return f"{stem}-rank-{dist.get_rank()}{suffix}"
    return f"{stem}{suffix}"


def operator_events(averages) -> list:
    """The averaged events that are operators: the `swiftlm step N` marks are left out."""
    return [e for e in averages if not getattr(e, "is_user_annotation", False)]


def operator_tables(averages, on_cuda: bool) -> str:
    """key_averages tables of the top operators by self CPU time (and self CUDA time)."""
    from torch.autograd.profiler_util import EventList

    events = EventList(  # the same columns as the unfiltered table (device time, memory)
        operator_events(averages),
        use_device=getattr(averages, "_use_device", None),
        profile_memory=getattr(averages, "_profile_memory", True),
    )
    sorts = [("self CPU time", "self_cpu_time_total")]
    if on_cuda:
        sorts.insert(0, ("self CUDA time", "self_device_time_total"))
    parts = []
    for title, key in sorts:
        table = events.table(sort_by=key, row_limit=TABLE_ROWS)
        parts.append(f"Top {TABLE_ROWS} operators by {title}\n{table}")
    return "\n\n".join(parts)


def describe_profile(steps: str, trace: Path, table: Path, events: list, on_cuda: bool) -> str:
    """The log lines: where the trace is, how to open it, the top operators and their share."""
    key, title = (
        ("self_device_time_total", "self CUDA time")
        if on_cuda
        else ("self_cpu_time_total", "self CPU time")
    )
    total = sum(getattr(e, key, 0) for e in events) or 1
    top = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:LOGGED_ROWS]
    lines = [
        f"profile of steps {steps}: {trace} (open it in {PERFETTO} or chrome://tracing); "
        f"top operators by {title} (more in {table.name}):"
    ]
    for e in top:
        us = getattr(e, key, 0)
        lines.append(
            f"  {100 * us / total:5.1f}%  {us / 1000:9.2f} ms  {e.count:6d} calls  {e.key}"
        )
    return "\n".join(lines)
