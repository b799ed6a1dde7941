"""The must-show of `swiftlm plan`, reduced: two real 2-process `swiftlm sft` runs on the CPUs
(SmolLM2-135M full DDP, a ~100M Llama with LoRA on ZeRO-2), each rank's peak RSS within 15% of
the planner's estimate. benchmarks/plan_accuracy.py runs the whole table (~13 minutes: 12 of 13
within 15%; LoRA on ZeRO-3 with checkpointing is outside it, see docs/benchmarks.md)."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_accuracy.py"


def _benchmark():
    spec = importlib.util.spec_from_file_location("plan_accuracy", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_memory_estimates_are_within_15_percent_of_two_measured_runs(tmp_path, capsys):
    bench = _benchmark()
    assert bench.main(["--quick", "--steps", "3", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["within"] == 2, out
    assert summary["max_error"] <= 0.15, out
    rows = [
        line
        for line in out.splitlines()
        if line.startswith("| SmolLM2") or line.startswith("| Llama")
    ]
    assert len(rows) == 2 and all("(" in row for row in rows)  # both ranks measured
