"""Steps worth a look: loss and gradient-norm spikes, and non-finite (skipped) steps.

A spike is a value above `--spike_factor` times the running median of the last WINDOW steps
(the median, not the mean, so one spike does not hide the next). Each anomaly is printed and
appended to `<run>/anomalies.jsonl`, which the report lists and marks on its curves.
"""

import json
import math
import statistics
from collections import deque
from pathlib import Path

WINDOW = 50
MIN_HISTORY = 10  # too few steps and the median says little: early training moves fast
FILE = "anomalies.jsonl"


class SpikeDetector:
    """One series (the loss, or the gradient norm)."""

    def __init__(self, kind: str, factor: float):
        self.kind, self.factor = kind, factor
        self.history: deque[float] = deque(maxlen=WINDOW)

    def check(self, step: int, value: float) -> dict | None:
        """The anomaly record if `value` spikes; the value joins the history either way."""
        if not math.isfinite(value):
            return None  # the non-finite path reports those
        anomaly = None
        if len(self.history) >= MIN_HISTORY:
            median = statistics.median(self.history)
            if median > 0 and value > self.factor * median:
                anomaly = {
                    "step": step,
                    "kind": f"{self.kind}_spike",
                    "value": value,
                    "median": median,
                    "factor": round(value / median, 2),
                    "message": (
                        f"step {step}: {self.kind} spike {value:.4g} "
                        f"({value / median:.1f}x its running median {median:.4g})"
                    ),
                }
        self.history.append(value)
        return anomaly


class AnomalyLog:
    """Spike detection for the loss and gradient norm, and the file every anomaly goes to."""

    def __init__(self, run_dir: Path, factor: float, log, resume: bool, enabled: bool = True):
        self.path = Path(run_dir) / FILE
        self.log, self.enabled = log, enabled
        self.detectors = {kind: SpikeDetector(kind, factor) for kind in ("loss", "grad_norm")}
        self.count = 0
        if enabled and not resume and self.path.exists():
            self.path.unlink()

    def check(self, step: int, loss: float, grad_norm: float) -> None:
        for kind, value in (("loss", loss), ("grad_norm", grad_norm)):
            anomaly = self.detectors[kind].check(step, value)
            if anomaly:
                self.record(anomaly)

    def record(self, anomaly: dict) -> None:
        self.count += 1
        if not self.enabled:
            return
        self.log(anomaly["message"])
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(anomaly) + "\n")
