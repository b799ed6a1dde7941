"""GRPO on the default model with the built-in verifiable task raises held-out accuracy by 15
points or more. Slow: about 15 minutes on 2 CPU cores (benchmarks/grpo_arithmetic.py runs the
longer curve of docs/benchmarks.md)."""

import importlib.util
import json
from pathlib import Path

import pytest

from swiftlm.cli.main import main

pytestmark = pytest.mark.slow
BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "grpo_arithmetic.py"


def _benchmark():
    spec = importlib.util.spec_from_file_location("grpo_arithmetic", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_on_the_arithmetic_task_raises_held_out_accuracy(tmp_path):
    bench = _benchmark()
    base = bench.base_accuracy()  # greedy, as GRPO's own evaluation
    run = tmp_path / "grpo"
    argv = ["rlhf", *bench.TRAIN, "--max_steps", "30", "--output_dir", str(run)]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["eval_rewards/accuracy"] for r in rows if "eval_rewards/accuracy" in r]
    assert len(accuracy) == 3  # steps 10, 20, 30
    # Measured: 0.425 before, 0.70 after 30 steps (docs/alignment.md, GRPO).
    assert 0.10 <= base <= 0.60, base  # the task is neither solved nor hopeless at the start
    assert accuracy[-1] >= base + 0.15, (base, accuracy)
