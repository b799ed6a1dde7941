"""Where each optimizer step's wall time goes: data, forward, backward, optimizer, collectives,
checkpoint saving, evaluation, writing the log and, for online methods, generation and
reward scoring.

The loop wraps each part in `timer.phase(name)`. Phases nest and are exclusive: time inside a
nested phase (a reward call inside the data phase, a collective inside backward) counts for
the inner phase only, so the phases of a step never overlap and, with `other` for whatever no
phase covered, add up to the step's wall time. A log line reports the mean seconds per step of
each phase over the steps since the last one (`time/<phase>_s`), its share (`share/<phase>`)
and `goodput`: the share spent computing (forward, backward, optimizer).

On CUDA the phases would measure kernel launches, not kernels, so each phase boundary
synchronizes the device: a few syncs per micro-batch. On CPU a phase costs two
`perf_counter` calls; `benchmarks/observability.py` measures the whole bookkeeping.
"""

import time
from contextlib import contextmanager

import torch

PHASES = (
    "data",
    "forward",
    "backward",
    "optimizer",
    "collective",
    "checkpoint",
    "evaluation",
    "generation",
    "reward",
    "logging",
    "profiler",
)
COMPUTE_PHASES = ("forward", "backward", "optimizer")


class StepTimer:
    """Exclusive, nested phase timing over the steps of one log window."""

    def __init__(self, device: torch.device | None = None, clock=time.perf_counter):
        self.clock = clock
        self.sync = device is not None and device.type == "cuda"
        self.device = device
        self._stack: list[list] = []  # [phase, time it last (re)started]
        self._reset_window()

    def _reset_window(self, now: float | None = None) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.window_start = self.clock() if now is None else now

    def restart(self) -> None:
        """Start the window now, dropping what was measured before."""
        self._reset_window()

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return self.clock()

    @contextmanager
    def phase(self, name: str):
        now = self._now()
        if self._stack:  # pause the enclosing phase
            outer = self._stack[-1]
            self.seconds[outer[0]] += now - outer[1]
        self._stack.append([name, now])
        try:
            yield
        finally:
            now = self._now()
            phase, started = self._stack.pop()
            self.seconds[phase] += now - started
            if self._stack:  # resume the enclosing phase
                self._stack[-1][1] = now

    def add(self, name: str, seconds: float, out_of: str | None = None) -> None:
        """Move `seconds` measured elsewhere (exposed communication, timed by the gradient
        hooks) into `name`, out of the phase that contained them."""
        self.seconds[name] += seconds
        if out_of is not None:
            self.seconds[out_of] -= seconds

    def step_done(self) -> None:
        self.steps += 1

    def flush(self) -> dict:
        """Mean seconds per step of each phase since the last flush, shares and goodput.

        A phase still open (the log line being written) is counted up to now, and goes on
        in the next window."""
        now = self._now()
        if self._stack:
            running = self._stack[-1]
            self.seconds[running[0]] += now - running[1]
            running[1] = now
        wall = now - self.window_start
        steps = max(self.steps, 1)
        measured = {name: max(s, 0.0) for name, s in self.seconds.items() if s > 0}
        measured["other"] = max(wall - sum(measured.values()), 0.0)
        total = sum(measured.values()) or 1.0
        row = {"time/step_s": wall / steps}
        row.update({f"time/{name}_s": s / steps for name, s in measured.items()})
        row.update({f"share/{name}": s / total for name, s in measured.items()})
        row["goodput"] = sum(measured.get(name, 0.0) for name in COMPUTE_PHASES) / total
        self._reset_window(now)
        return {key: round(value, 6) for key, value in row.items()}


class NullTimer(StepTimer):
    """No bookkeeping (the benchmark's baseline)."""

    @contextmanager
    def phase(self, name: str):
        yield

    def add(self, name: str, seconds: float, out_of: str | None = None) -> None:
        pass

    def flush(self) -> dict:
        return {}
