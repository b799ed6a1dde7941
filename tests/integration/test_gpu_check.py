"""scripts/gpu_check.py, the GPU check of issue 32, in its --smoke mode on this CPU: every
part runs (the machine, the model built in-process, SFT, DPO, GRPO, serving) and writes its
figures, so the script works the day a GPU machine is lent and its few minutes are not spent
on a broken script. On a GPU it runs with the full settings through scripts/gpu_check.sh."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--smoke", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


def test_every_part_ran_and_reported_its_figures(report):
    assert report["smoke"] is True and report["failed_parts"] == []
    assert report["machine"]["bf16_peak_tflops"] > 0 and report["machine"]["torch"]
    assert report["model"]["num_hidden_layers"] == 2
    assert report["sft"]["steps"] == 3 and report["sft"]["tokens_per_second"] > 0
    assert 0 < report["sft"]["mfu"] < 1
    assert report["sft_fp8"]["steps"] == 3 and report["sft_fp8"]["tokens_per_second"] > 0
    for part in ("dpo", "grpo"):
        run = report[part]["swiftlm"]
        assert run["exit_code"] == 0 and run["steps"] == 4 and run["median_step_s"] > 0
    levels = report["serving"]["swiftlm"]
    assert set(levels) == {"1", "2"}
    assert levels["2"]["output_tokens"] == 4 * 8  # 4 prompts x 8 tokens, end of turn ignored


def test_a_failed_run_inside_a_part_fails_the_check():
    from gpu_check import _failed

    assert not _failed({"swiftlm": {"exit_code": 0, "median_step_s": 1.0}, "part_s": 2})
    assert _failed({"swiftlm": {"exit_code": 1, "error": "exit code 1: ..."}})
    assert _failed({"exit_code": "timeout"}) and _failed({"error": "ValueError: x"})
