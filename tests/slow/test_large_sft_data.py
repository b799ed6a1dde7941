"""The must-show of large SFT data: `swiftlm sft` on 1,000,000 generated chat rows (~0.5 GB)
encodes them for the first time with the main process's peak memory under 2.5 GB, reports
its throughput, and a cached rerun costs less still (benchmarks/large_sft_data.py measures
the same; about 30 minutes on a 2-core machine)."""

import importlib.util
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "large_sft_data.py"
ROWS = 1_000_000
PEAK_GB = 2.5


def _benchmark():
    spec = importlib.util.spec_from_file_location("large_sft_data", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_million_rows_encode_and_train_under_the_memory_bound(tmp_path):
    bench = _benchmark()
    data = tmp_path / "chat.jsonl"
    size = bench.write_rows(data, ROWS)
    assert 0.45e9 < size < 0.6e9
    model = bench.tiny_model(tmp_path / "tiny-model")
    cache = tmp_path / "cache"
    first = bench.run_sft(model, data, tmp_path / "run1", cache, 1, tmp_path / "first.log")
    assert first["samples"] == ROWS and first["rows_per_s"] > 0 and first["tokens_per_s"] > 0
    assert first["peak_gb"] < PEAK_GB, first
    assert "cached at" in (tmp_path / "first.log").read_text()
    second = bench.run_sft(model, data, tmp_path / "run2", cache, 1, tmp_path / "second.log")
    assert "loaded from cache" in (tmp_path / "second.log").read_text()
    assert second["peak_gb"] < first["peak_gb"], (first, second)
