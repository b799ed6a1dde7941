"""DPO on the default model with the built-in preference data changes what the data asks for:
answers to held-out questions get shorter. Slow: ~7 minutes of training on 2 CPU cores."""

import json
import statistics

import pytest

from swiftlm.cli.main import main

pytestmark = pytest.mark.slow


def answer_lengths(result_path, tokenizer) -> list[int]:
    rows = [json.loads(line) for line in result_path.read_text().splitlines()]
    return [len(tokenizer(row["response"])["input_ids"]) for row in rows]


def test_dpo_on_concise_pairs_shortens_held_out_answers(tmp_path):
    from transformers import AutoTokenizer

    from swiftlm.models.loader import resolve_model

    run, heldout = tmp_path / "dpo", ["--val_dataset", "swiftlm/concise-heldout"]
    answer = ["infer", *heldout, "--max_new_tokens", "128", "--result_path"]
    assert main([*answer, str(tmp_path / "base.jsonl")]) == 0
    train = ["rlhf", "--dataset", "swiftlm/concise-preference", "--output_dir", str(run)]
    steps = ["--num_train_epochs", "2", "--per_device_train_batch_size", "4"]
    assert main([*train, *steps, "--gradient_accumulation_steps", "2"]) == 0
    assert main(["infer", "--ckpt_dir", str(run), *answer[1:], str(tmp_path / "dpo.jsonl")]) == 0

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    before = answer_lengths(tmp_path / "base.jsonl", tokenizer)
    after = answer_lengths(tmp_path / "dpo.jsonl", tokenizer)
    assert len(before) == len(after) == 42
    # Measured: mean 78.5 -> 26.8 tokens; answers of at most 25 tokens 8 -> 34 of 42.
    assert statistics.mean(after) <= 0.7 * statistics.mean(before)
    assert sum(n <= 25 for n in after) >= 1.3 * sum(n <= 25 for n in before)
