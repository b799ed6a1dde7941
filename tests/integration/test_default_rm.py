"""A reward model of the default model on the built-in preference pairs ranks held-out pairs
by a wider margin: the example of docs/alignment.md. Slow: 24 minutes of training on 2 busy CPU cores."""

import json

import pytest

from swiftlm.cli.main import main

pytestmark = pytest.mark.slow


def test_a_reward_model_of_the_default_model_ranks_held_out_pairs(tmp_path):
    run = tmp_path / "rm"
    train = ["rlhf", "--rlhf_type", "rm", "--dataset", "swiftlm/concise-preference"]
    steps = ["--num_train_epochs", "1", "--per_device_train_batch_size", "4"]
    held_out = ["--split_dataset_ratio", "0.2", "--gradient_accumulation_steps", "2"]
    assert main([*train, *steps, *held_out, "--output_dir", str(run)]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evaluated = [row for row in rows if "eval_rewards/accuracies" in row][-1]
    # Measured on the 25 held-out pairs after 13 steps (bf16): accuracy 1.0, eval loss 0.228,
    # mean margin 1.41. The untrained head (seed 42) already ranks all 25 right (these pairs
    # differ by length and filler), but with loss 0.524 and margin 0.38: training widens it.
    assert evaluated["eval_rewards/accuracies"] >= 0.8
    assert evaluated["eval_loss"] < 0.4 and evaluated["eval_rewards/margins"] > 1.0
    answers = [
        [
            {"role": "user", "content": "What is the capital of Japan?"},
            {"role": "assistant", "content": answer},
        ]
        for answer in (
            "The capital of Japan is Tokyo.",
            "What a great question! The capital of Japan is Tokyo. I hope this helps!",
        )
    ]
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in answers))
    scored = tmp_path / "scores.jsonl"
    score = ["infer", "--task", "score", "--ckpt_dir", str(run), "--val_dataset", str(data)]
    assert main([*score, "--result_path", str(scored)]) == 0
    concise, wordy = (json.loads(line)["score"] for line in scored.read_text().splitlines())
    assert concise > wordy
