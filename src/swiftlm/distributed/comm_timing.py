"""How long gradient communication takes, how much of it training waits for, and how close it
comes to what the link can do.

- `timed(hook)` wraps a DDP communication hook: each bucket's collective is timed from the
  hook's call (the bucket is ready) to its future's completion, on the thread that completes
  it. The union of those intervals is the time the link was busy; bytes on the wire (the
  ring model of `compression.CommStats`) over that time is the achieved bus bandwidth.
- Exposed communication: DDP's backward returns only when every bucket is reduced. What it
  waits after the last bucket became ready (the end of the gradient computation) is
  communication that compute did not hide; the rest of the busy time ran behind backward.
- `probe_bus_bandwidth` all-reduces a buffer a few times at start: the link's practical peak,
  which `communication_efficiency` divides by.

On CUDA a future completes when NCCL's work is done on its stream, so the same timing holds;
it was measured on gloo (CPU) here.
"""

import functools
import statistics
import time

import torch
import torch.distributed as dist

# The probe: big enough to reach the link's bandwidth, small enough to cost < 1 s.
PROBE_BYTES = {"cpu": 16 * 2**20, "cuda": 256 * 2**20}
PROBE_ROUNDS = 5


def ring_allreduce_bytes(payload: int, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce (the 'bus bytes' of nccl-tests)."""
    return 2 * (world_size - 1) * payload / world_size


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


class CommTimer:
    """Bucket intervals of the current log window, and the last bucket's ready time."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.intervals: list[tuple[float, float]] = []
        self.last_ready = 0.0  # when the latest bucket's hook was called

    def ready(self) -> float:
        self.last_ready = self.clock()
        return self.last_ready

    def done(self, started: float) -> None:
        self.intervals.append((started, self.clock()))  # list.append is atomic under the GIL

    def exposed_since(self, backward_end: float, backward_start: float) -> float:
        """Seconds a backward that ran from `backward_start` to `backward_end` waited for
        communication after its last bucket was ready (0 if no bucket was ready in it)."""
        if self.last_ready < backward_start:
            return 0.0
        return max(0.0, backward_end - self.last_ready)

    def busy_and_reset(self) -> float:
        busy = union_seconds(self.intervals)
        self.intervals = []
        return busy


def timed(hook, timer: CommTimer):
    """`hook` (state, bucket) -> Future, with each bucket's collective timed by `timer`."""

    @functools.wraps(hook)  # run.__wrapped__ is the hook: what was chosen stays visible
    def run(state, bucket):
        started = timer.ready()
        future = hook(state, bucket)

        def finished(done: torch.futures.Future):
            timer.done(started)
            return done.value()

        return future.then(finished)

    return run


def probe_bus_bandwidth(group, device: torch.device) -> float:
    """Median bus bandwidth (bytes/s) of an all-reduce over `group`, after one warm-up."""
    world = dist.get_world_size(group)
    size = PROBE_BYTES.get(device.type, PROBE_BYTES["cpu"])
    buffer = torch.ones(size // 4, dtype=torch.float32, device=device)
    dist.all_reduce(buffer, group=group)  # warm-up: connections, allocator
    rates = []
    for _ in range(PROBE_ROUNDS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        dist.all_reduce(buffer, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rates.append(ring_allreduce_bytes(size, world) / (time.perf_counter() - started))
    # Every rank takes rank 0's figure: one peak for the whole job.
    peak = torch.tensor([statistics.median(rates)], dtype=torch.float64, device=device)
    dist.broadcast(peak, src=dist.get_global_rank(group, 0), group=group)
    return float(peak.item())
