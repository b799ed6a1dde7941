"""Where metrics go: metrics.jsonl (always), the --report_to loggers, a progress bar, a summary."""

import json
import resource
import sys
import time
from pathlib import Path

import torch

from swiftlm.monitor.loggers import open_loggers


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, peak RSS elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


HISTOGRAMS_FILE = "grad_histograms.jsonl"


def _scalars(metrics: dict) -> dict[str, float]:
    """The numbers of a log row for the loggers; a dict of numbers (per-layer gradient norms)
    becomes `name/key` scalars."""
    scalars = {}
    for key, value in metrics.items():
        if key == "step":
            continue
        if isinstance(value, (int, float)):
            scalars[key] = value
        elif isinstance(value, dict):
            for inner, number in value.items():
                if isinstance(number, (int, float)):
                    scalars[f"{key}/{inner}"] = number
    return scalars


class MetricsLogger:
    """Append one JSON object per logged step; mirror its scalars to the --report_to loggers."""

    def __init__(
        self, run_dir: Path, report_to: list[str], resume: bool = False, enabled: bool = True
    ):
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled  # only rank 0 writes
        self.loggers = []
        if not enabled:
            return
        if not resume:  # a fresh run in a reused directory starts its files over
            self.path.unlink(missing_ok=True)
            (run_dir / HISTOGRAMS_FILE).unlink(missing_ok=True)
        self.loggers = open_loggers(run_dir, report_to, resume)

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")
        scalars = _scalars(metrics)
        for logger in self.loggers:
            logger.log(scalars, metrics["step"])

    def log_histograms(self, record: dict) -> None:
        """`{"step", "edges", "layers": {group: counts}}` to grad_histograms.jsonl (the
        report's) and to every logger that draws histograms (TensorBoard)."""
        if not self.enabled:
            return
        with (self.path.parent / HISTOGRAMS_FILE).open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        for logger in self.loggers:
            if hasattr(logger, "log_histograms"):
                logger.log_histograms(record["edges"], record["layers"], record["step"])

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


class Progress:
    """A tqdm bar over optimizer steps showing loss, lr and tokens/s (tqdm adds the ETA)."""

    def __init__(self, total: int, initial: int, enabled: bool = True):
        from tqdm.auto import tqdm

        self.enabled = enabled
        self.bar = tqdm(
            total=total,
            initial=initial,
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            disable=not enabled,
        )

    def update(self, loss: float, lr: float, tokens_per_second: float) -> None:
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_second:.0f}")
        self.bar.update(1)

    def write(self, text: str) -> None:
        if self.enabled:
            self.bar.write(text)

    def close(self) -> None:
        self.bar.close()


class Throughput:
    """Tokens per second over a window of steps."""

    def __init__(self):
        self.start = time.perf_counter()
        self.tokens = 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def rate(self) -> float:
        elapsed = time.perf_counter() - self.start
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def reset(self) -> None:
        self.start, self.tokens = time.perf_counter(), 0


def _format_value(key: str, value) -> str:
    if not isinstance(value, float):
        return str(value)
    if key.endswith(("per_second", "_s")):
        return f"{value:.1f}"
    return f"{value:.4f}"


SUMMARY_FILE = "summary.json"


def write_summary(run_dir: Path, summary: dict) -> None:
    """The end-of-run summary, kept in the run directory (the report's first table)."""
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")


# summary.json keys, in the order the end-of-run block (and the report's table) shows them.
SUMMARY_LABELS = {
    "steps": "optimizer steps",
    "train_time_s": "train time (s)",
    "tokens_per_second": "tokens/s",
    "label_tokens_per_second": "label tokens/s",
    "mfu": "MFU",
    "peak_memory_gib": "peak memory (GiB)",
    "final_train_loss": "final train loss",
    "final_eval_loss": "final eval loss",
    "skipped_steps": "skipped steps",
    "best_metric": "best metric",
    "best_checkpoint": "best checkpoint",
    "output": "model saved to",
}


def format_summary(summary: dict) -> str:
    """The end-of-run block."""
    lines = ["", "Run summary"]
    for key, label in SUMMARY_LABELS.items():
        value = summary.get(key)
        if value is None or (key == "skipped_steps" and not value):
            continue
        text = _format_value(key, value)
        lines.append(f"  {label:<20} {text}")
    return "\n".join(lines)
