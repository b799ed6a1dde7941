"""What one optimizer step reports, and the log window that averages it between log lines."""

import math
from dataclasses import dataclass, field

from swiftlm.monitor.metrics import Throughput


@dataclass
class StepResult:
    """One optimizer step, summed over micro-batches and data-parallel ranks."""

    loss: float  # the step's mean loss: loss sum / normalizer
    normalizer: float  # what the method's loss was averaged over (tokens, pairs, weights ...)
    label_tokens: int
    input_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)  # each already / normalizer
    local_loss: float = 0.0  # this rank's loss sum (which rank went non-finite)


class LogWindow:
    """Normalizer-weighted loss and metrics, and throughput, over the steps since the last
    log line."""

    def __init__(self):
        self.throughput = Throughput()
        self._reset()

    def _reset(self) -> None:
        self.loss_sum, self.normalizer, self.label_tokens = 0.0, 0.0, 0
        self.metric_sums: dict[str, float] = {}

    def add(self, step: StepResult) -> None:
        self.throughput.add(step.input_tokens)
        if not math.isfinite(step.loss):  # a skipped non-finite step must not poison the mean
            return
        self.loss_sum += step.loss * step.normalizer
        self.normalizer += step.normalizer
        self.label_tokens += step.label_tokens
        for name, value in step.metrics.items():
            self.metric_sums[name] = self.metric_sums.get(name, 0.0) + value * step.normalizer

    def flush(self) -> dict:
        divisor = self.normalizer if self.normalizer > 0 else 1.0
        row = {
            "loss": self.loss_sum / divisor,
            "tokens_per_second": self.throughput.rate(),
            "label_tokens": self.label_tokens,
            **{name: total / divisor for name, total in self.metric_sums.items()},
        }
        self.throughput.reset()
        self._reset()
        return row


def mfu_metric(job, tokens_per_second: float) -> dict:
    """Model FLOPs utilization of the logged window (useful tokens only, not padding)."""
    if not job.flops_per_token or not job.peak_flops:
        return {}
    return {"mfu": round(tokens_per_second * job.flops_per_token / job.peak_flops, 4)}
