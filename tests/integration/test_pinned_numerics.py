"""Pinned numerics (torchtune style): the first 10 losses and the final gradient norm of tiny
fp32 runs, recorded before the method/loop redesign, must come out the same afterwards.

A silent change in masking, normalization, batching or the loss shows here as a drift. The
expected values live in `pinned_numerics.json`, which only `scripts/update_pins.py fp32`
writes (a change that is meant to alter the numbers reruns it and says so in its commit);
this test only compares.
"""

import json
from pathlib import Path

import pytest

from conftest import CHAT_ROWS, logged, write_jsonl
from swiftlm.cli.main import main
from tolerance import assert_close, backward_terms, forward_terms

EXPECTED = Path(__file__).with_name("pinned_numerics.json")
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
    return {
        "losses": logged(out, "loss"),
        "final_grad_norm": logged(out, "grad_norm")[-1],
        "label_tokens": logged(out, "label_tokens"),
    }


@pytest.mark.numerics
@pytest.mark.parametrize("name", sorted(CASES))
def test_pinned_losses_and_grad_norm(name, tiny_model_dir, tmp_path):
    got = run_case(name, tiny_model_dir, tmp_path)
    pinned = json.loads(EXPECTED.read_text())[name]
    # Which tokens each step's loss is over depends on masking, packing and batching alone,
    # never on rounding: exactly equal.
    assert got["label_tokens"] == pinned["label_tokens"]
    assert len(got["losses"]) == len(pinned["losses"]) == 10
    # The pins were recorded on another machine's kernels (AVX2, AVX-512 and AMX order their
    # float32 sums differently), so each value is compared within the rounding of the sums
    # behind it (tests/tolerance.py): a step's loss is a mean over its label tokens, which
    # also bound each sequence's length. At 124 tokens that is 6 * sqrt(1828) * eps ~ 3e-5 of
    # the value (~2e-4 at loss 6.3); AVX2 against AVX-512 differ by at most 4e-7 of it, a
    # masking or normalizer bug by percents.
    for step, (value, want, tokens) in enumerate(
        zip(got["losses"], pinned["losses"], pinned["label_tokens"], strict=True), start=1
    ):
        assert_close(value, want, terms=forward_terms(tokens), what=f"{name} loss at step {step}")
    assert_close(
        got["final_grad_norm"],
        pinned["final_grad_norm"],
        terms=backward_terms(pinned["label_tokens"][-1]),
        what=f"{name} final grad norm",
    )
