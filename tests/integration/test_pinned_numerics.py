"""Pinned numerics (torchtune style): the first 10 losses and the final gradient norm of tiny
fp32 runs, recorded before the method/loop redesign, must come out the same afterwards.

A silent change in masking, normalization, batching or the loss shows here as a drift. The
expected values live in `pinned_numerics.json`; `SWIFTLM_PIN_UPDATE=1 pytest -k pinned`
rewrites them, which a change that is meant to alter the numbers says in its commit.
"""

import json
import os
from pathlib import Path

import pytest

from conftest import CHAT_ROWS, logged, write_jsonl
from swiftlm.cli.main import main

EXPECTED = Path(__file__).with_name("pinned_numerics.json")
FP32_TOLERANCE = 1e-6
DOCS = [{"text": f"The quick brown fox {i} jumps over the lazy dog. " * 5} for i in range(12)]

COMMON = ["--torch_dtype", "float32", "--report_to", "none", "--logging_steps", "1"]
COMMON += ["--max_steps", "10", "--save_steps", "100", "--seed", "7"]
CASES = {
    "sft_lora": ["sft", "--learning_rate", "5e-3", "--lora_dropout", "0"],
    "sft_full": ["sft", "--train_type", "full", "--learning_rate", "1e-3"],
    "sft_lora_packed_accum": [
        "sft",
        "--learning_rate",
        "5e-3",
        "--lora_dropout",
        "0",
        "--packing",
        "true",
        "--max_length",
        "64",
        "--gradient_accumulation_steps",
        "2",
    ],
    "sft_lora_padded": ["sft", "--learning_rate", "5e-3", "--padding_free", "false"],
    "pt_lora": ["pt", "--learning_rate", "5e-3", "--max_length", "32"],
    "pt_full": ["pt", "--train_type", "full", "--learning_rate", "1e-3", "--max_length", "32"],
}


def run_case(name: str, model_dir: Path, tmp_path: Path) -> dict:
    command, *flags = CASES[name]
    rows = CHAT_ROWS if command == "sft" else DOCS
    data = write_jsonl(tmp_path / f"{command}.jsonl", rows)
    out = tmp_path / name
    argv = [command, "--model", str(model_dir), "--dataset", str(data), "--output_dir", str(out)]
    argv += ["--per_device_train_batch_size", "4", *COMMON, *flags]
    assert main(argv) == 0
    return {"losses": logged(out, "loss"), "final_grad_norm": logged(out, "grad_norm")[-1]}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pinned_losses_and_grad_norm(name, tiny_model_dir, tmp_path):
    got = run_case(name, tiny_model_dir, tmp_path)
    expected = json.loads(EXPECTED.read_text()) if EXPECTED.is_file() else {}
    if os.environ.get("SWIFTLM_PIN_UPDATE") == "1":
        expected[name] = got
        EXPECTED.write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
        return
    pinned = expected[name]
    assert len(got["losses"]) == len(pinned["losses"]) == 10
    for step, (value, want) in enumerate(
        zip(got["losses"], pinned["losses"], strict=True), start=1
    ):
        assert value == pytest.approx(want, abs=FP32_TOLERANCE), f"step {step}"
    assert got["final_grad_norm"] == pytest.approx(pinned["final_grad_norm"], abs=FP32_TOLERANCE)
