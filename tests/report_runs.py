"""Synthetic run directories for the report and dashboard tests: every file of the run-directory
contract (metrics with the step-time breakdown, per-layer gradient norms, per-rank times and
method metrics; anomalies; gradient histograms; data health; summary; config; profiler), so
the tests do not need a training run that writes all of them."""

import json
import math
from pathlib import Path

import yaml

PHASES = ("data", "forward", "backward", "optimizer", "collective", "other")
GROUPS = ("embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "lm_head")
SPIKE_STEP = 15
STEPS = 40


def config(learning_rate: float = 1e-4) -> dict:
    return {
        "model": {"model": "tiny-llama", "torch_dtype": "float32"},
        "data": {"dataset": ["chat.jsonl"], "max_length": 256},
        "train": {"learning_rate": learning_rate, "max_steps": STEPS, "logging_steps": 1},
        "output": {"output_dir": "run"},
    }


def train_row(step: int, ranks: int = 4, lr: float = 1e-4) -> dict:
    """One logged step; rank 2 is a straggler, the phases share the step time."""
    times = {"data": 0.02, "forward": 0.3, "backward": 0.5, "optimizer": 0.05}
    times["collective"] = 0.1
    times["other"] = 0.03
    step_s = sum(times.values())
    loss = 3.0 * math.exp(-step / 20) + 0.5 + (4.0 if step == SPIKE_STEP else 0.0)
    row = {
        "step": step,
        "epoch": step / STEPS,
        "loss": loss,
        "learning_rate": lr * min(1.0, step / 5),
        "grad_norm": 1.0 + 0.1 * math.sin(step) + (9.0 if step == 25 else 0.0),
        "tokens_per_second": 1000.0 + 10 * step,
        "label_tokens": 512,
        "memory_gib": 1.5 + 0.01 * step,
        "elapsed_s": step * step_s,
        "mfu": 0.3,
        "compute_efficiency": 0.3,
        "time/step_s": step_s,
        "goodput": (times["forward"] + times["backward"] + times["optimizer"]) / step_s,
        "grad_norm_layers": {g: 10 ** (-i / 2) * (1 + step / 40) for i, g in enumerate(GROUPS)},
        "skipped_steps": 0,
        "reward": 0.1 * step,
        "rewards/accuracy": min(1.0, step / 30),
        "kl": 0.01 * step,
    }
    for phase, seconds in times.items():
        row[f"time/{phase}_s"] = seconds
        row[f"share/{phase}"] = seconds / step_s
    if ranks > 1:
        row["communication_efficiency"] = 0.6
        row["comm_hidden_share"] = 0.4
        row["comm_bus_gbps"] = 12.0
        row["rank_step_s"] = [step_s * (1.6 if r == 2 else 1.0) for r in range(ranks)]
        row["rank_utilization"] = [0.55 if r == 2 else 0.9 for r in range(ranks)]
    return row


def eval_row(step: int) -> dict:
    return {"step": step, "eval_loss": 2.0 * math.exp(-step / 25) + 0.6, "eval_accuracy": 0.5}


def histograms(step: int) -> dict:
    edges = [-8 + 0.5 * i for i in range(17)]
    return {
        "step": step,
        "edges": edges,
        "layers": {
            g: [int(100 * math.exp(-((i - 8 + k) ** 2) / 6)) for i in range(16)]
            for k, g in enumerate(GROUPS)
        },
    }


def data_health() -> dict:
    return {
        "rows": 1000,
        "tokens": {"total": 250000, "label_share": 0.42, "truncated_rows": 3},
        "lengths": {"edges": [0, 64, 128, 192, 256], "counts": [100, 500, 300, 100]},
        "batching": {"layout": "padded", "padding_efficiency": 0.81},
    }


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_run(path: Path, learning_rate: float = 1e-4, ranks: int = 4, full: bool = True) -> Path:
    """A finished run at `path`. `full=False`: only config.yaml and metrics.jsonl (train rows,
    no breakdown, no eval) as a plain old run would have."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(yaml.safe_dump(config(learning_rate), sort_keys=False))
    if not full:
        rows = [
            {k: train_row(s)[k] for k in ("step", "loss", "learning_rate", "grad_norm")}
            for s in range(1, STEPS + 1)
        ]
        write_jsonl(path / "metrics.jsonl", rows)
        return path
    rows = []
    for step in range(1, STEPS + 1):
        rows.append(train_row(step, ranks, learning_rate))
        if step % 10 == 0:
            rows.append(eval_row(step))
    # A resume from step 18 logs 19 and 20 again: the later rows must win.
    rows += [
        train_row(19, ranks, learning_rate),
        {**train_row(20, ranks, learning_rate), "loss": 0.25},
    ]
    write_jsonl(path / "metrics.jsonl", rows)
    write_jsonl(
        path / "anomalies.jsonl",
        [
            {
                "step": SPIKE_STEP,
                "kind": "loss_spike",
                "value": 6.0,
                "median": 1.5,
                "factor": 4.0,
                "message": f"loss 6.0 at step {SPIKE_STEP} is 4.0x its median",
            },
            {
                "step": 25,
                "kind": "grad_norm_spike",
                "value": 10.0,
                "median": 1.0,
                "factor": 10.0,
                "message": "grad norm 10.0 at step 25 is 10x its median",
            },
        ],
    )
    write_jsonl(path / "grad_histograms.jsonl", [histograms(1), histograms(20), histograms(40)])
    (path / "data_health.json").write_text(json.dumps(data_health()))
    summary = {
        "steps": STEPS,
        "train_time_s": 40.0,
        "tokens_per_second": 1200.0,
        "mfu": 0.3,
        "peak_memory_gib": 1.9,
        "final_train_loss": 0.9,
        "final_eval_loss": 1.0,
        "skipped_steps": 0,
        "output": str(path / "final"),
    }
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "profile").mkdir(exist_ok=True)
    (path / "profile" / "top_operators.txt").write_text("aten::mm  45.0%\naten::add  3.0%\n")
    return path
