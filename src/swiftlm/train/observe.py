"""What the loop tells about each step besides its loss: where the time went, how well the
gradient communication did, gradient health by layer, spikes, and the profiler window.

The loop enters each part of a step through `observer.phase(name)`, which times it
(`monitor.step_time`) and beats the heartbeat (hang detection) at once; at each log line
`log_row()` adds the breakdown, per-layer gradient norms, communication figures and, in
distributed runs, every rank's step time and utilization (a straggler stands out).
"""

import statistics
import time
from contextlib import contextmanager

import psutil
import torch
import torch.distributed as dist

from swiftlm.monitor.anomalies import AnomalyLog
from swiftlm.monitor.grad_health import HIST_EDGES, GradientHealth
from swiftlm.monitor.profiler import StepProfiler
from swiftlm.monitor.step_time import StepTimer


class Observer:
    """Built once per run, after the strategy wrapped the model."""

    def __init__(self, job, num_steps: int, resume: bool):
        self.job, self.ctx = job, job.strategy.ctx
        self.num_steps = num_steps
        self.step = 0
        self.layer_norms: dict[str, float] = {}  # of the step last logged
        self.histogram: dict | None = None  # of this step, when it draws them
        self.timer = StepTimer(job.device)
        self.health = GradientHealth(job.model)
        self.anomalies = AnomalyLog(
            job.run_dir, job.monitor.spike_factor, job.log, resume, enabled=self.ctx.is_main
        )
        self.profiler = StepProfiler(job.monitor, job.run_dir, job.device, job.log, num_steps)
        self.comm_timer = getattr(job.strategy, "comm_timer", None)
        self.exposed_s = 0.0  # communication backward waited for, this log window
        self.peak_bus = self._probe_link()
        self._cpu = _CpuClock()
        self.router_counts: torch.Tensor | None = None  # [layers, experts], this log window

    def _probe_link(self) -> float | None:
        probe = getattr(self.job.strategy, "probe_link", None)
        peak = probe(self.job.model) if probe and self.comm_timer is not None else None
        if peak:
            self.job.log(f"gradient all-reduce link: {peak / 1e9:.2f} GB/s bus bandwidth (probe)")
        return peak

    @contextmanager
    def phase(self, name: str):
        if self.job.heartbeat is not None:
            self.job.heartbeat.beat(self.step, name)
        with self.timer.phase(name):
            yield

    @contextmanager
    def backward(self, last_micro_batch: bool):
        """The backward phase; on the micro-batch that reduces gradients, the wait for the
        reduction after the last bucket was ready moves to the collective phase."""
        with self.phase("backward"):
            started = time.perf_counter()
            yield
            if last_micro_batch and self.comm_timer is not None:
                exposed = self.comm_timer.exposed_since(time.perf_counter(), started)
                self.exposed_s += exposed
                self.timer.add("collective", exposed, out_of="backward")

    def add_router_counts(self, counts: torch.Tensor) -> None:
        """A micro-batch's slots routed to each expert of each MoE layer (stays on device)."""
        seen = self.router_counts
        self.router_counts = counts if seen is None else seen + counts

    def step_begin(self, step: int) -> None:
        if self.step == 0:  # the loop's setup is not part of the first step
            self.timer.restart()
        self.step = step
        self.profiler.step_begin(step)

    def logs(self, step: int) -> bool:
        """Whether `step` writes a log line: the first, every --logging_steps, the last."""
        every = self.job.output.logging_steps
        return step == 1 or step % every == 0 or step == self.num_steps

    def gradients_ready(self, step: int) -> None:
        """Called between backward and zero_grad: read what the log needs of the gradients."""
        if self.logs(step):
            self.layer_norms = self.health.layer_norms()
        every = self.job.monitor.histogram_steps
        if every and (step == 1 or step % every == 0):
            self.histogram = {"step": step, "edges": HIST_EDGES, "layers": self.health.histograms()}

    def step_end(self, step: int, loss: float, grad_norm: float) -> None:
        self.timer.step_done()
        self.anomalies.check(step, loss, grad_norm)
        if self.profiler.active:  # writing a trace may take a while: a phase of its own
            with self.phase("profiler"):
                self.profiler.step_end(step)

    def log_row(self, strategy_metrics: dict) -> dict:
        """The observability part of a log line (every rank calls it: it reduces)."""
        steps = max(self.timer.steps, 1)
        row = self.timer.flush()
        row["grad_norm_layers"] = self.layer_norms
        row.update(self._comm_row(strategy_metrics.get("comm_bytes_per_rank"), steps))
        if self.ctx.distributed:
            row.update(self._ranks_row(row["time/step_s"]))
        row["anomalies"] = self.anomalies.count
        row.update(self._router_row())
        return row

    def _router_row(self) -> dict:
        """Each MoE layer's share of routed slots per expert over the window (all ranks), and
        the most loaded expert's share times the number of experts (1 = even load)."""
        counts, self.router_counts = self.router_counts, None
        if counts is None:
            return {}
        if self.ctx.distributed:
            dist.all_reduce(counts)
        shares = counts / counts.sum(-1, keepdim=True).clamp(min=1)
        names = self.job.routers.layer_names
        return {
            "router_load_max": round(float(shares.max() * shares.shape[-1]), 4),
            "router_expert_load": {
                name: [round(v, 5) for v in line]
                for name, line in zip(names, shares.tolist(), strict=True)
            },
        }

    def _comm_row(self, bytes_per_step: int | None, steps: int) -> dict:
        if self.comm_timer is None:
            return {}
        busy, exposed = self.comm_timer.busy_and_reset(), self.exposed_s
        self.exposed_s = 0.0
        if busy <= 0 or not bytes_per_step:
            return {}
        bus = bytes_per_step * steps / busy
        row = {
            "comm_busy_s": round(busy / steps, 6),
            "comm_exposed_s": round(exposed / steps, 6),
            "comm_bus_gbps": round(bus / 1e9, 4),
            "comm_hidden_share": round(min(max(1 - exposed / busy, 0.0), 1.0), 4),
        }
        if self.peak_bus:
            row["communication_efficiency"] = round(bus / self.peak_bus, 4)
        return row

    def _ranks_row(self, step_s: float) -> dict:
        mine = torch.tensor([step_s, self._cpu.utilization(self.job.device)], dtype=torch.float64)
        if dist.get_backend() == "nccl":
            mine = mine.cuda()
        everyone = [torch.zeros_like(mine) for _ in range(self.ctx.world_size)]
        dist.all_gather(everyone, mine)
        rows = [t.cpu().tolist() for t in everyone]
        slowest = max(r[0] for r in rows)
        median = statistics.median(r[0] for r in rows)
        return {
            "rank_step_s": [round(r[0], 6) for r in rows],
            "rank_utilization": [round(r[1], 4) for r in rows],
            "straggler_ratio": round(slowest / median, 4) if median > 0 else 1.0,
        }

    def take_histogram(self) -> dict | None:
        """Per-layer log10|gradient| histograms of this step (step 1, every
        --histogram_steps), once."""
        histogram, self.histogram = self.histogram, None
        return histogram

    def close(self) -> None:
        self.profiler.close()


class _CpuClock:
    """The share of the window this rank's device was busy: CUDA's utilization counter, or
    on CPU the process's CPU time over wall time x the threads torch may use."""

    def __init__(self):
        self.process = psutil.Process()
        self.last = (time.perf_counter(), self._cpu_seconds())

    def _cpu_seconds(self) -> float:
        times = self.process.cpu_times()
        return times.user + times.system

    def utilization(self, device: torch.device) -> float:
        if device.type == "cuda":
            try:
                return torch.cuda.utilization(device) / 100
            except Exception:  # noqa: BLE001 - needs pynvml/amdsmi; fall back to the CPU figure
                pass
        now = (time.perf_counter(), self._cpu_seconds())
        wall, cpu = now[0] - self.last[0], now[1] - self.last[1]
        self.last = now
        threads = max(torch.get_num_threads(), 1)
        return min(cpu / (wall * threads), 1.0) if wall > 0 else 0.0
