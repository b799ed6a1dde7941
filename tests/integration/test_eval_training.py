"""Evaluation during training: --eval_dataset's generation metrics every --eval_steps, and
--metric_for_best_model keeping the best checkpoint through --save_total_limit and resume."""

import json
import shutil

import pytest

from conftest import tiny_sft, write_jsonl
from swiftlm.cli.main import main
from tolerance import assert_close, forward_terms

TEXTS = [{"text": "Hello! How can I help you today?"}, {"text": "The quick brown fox."}]
QA = [
    {
        "messages": [
            {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "content": "I am a helpful assistant."},
        ]
    }
]


def eval_rows(run) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if any(k.startswith("eval/") for k in r)]


def test_best_checkpoint_is_kept_and_named(tiny_model_dir, chat_jsonl, tmp_path):
    texts = write_jsonl(tmp_path / "texts.jsonl", TEXTS)
    qa = write_jsonl(tmp_path / "qa.jsonl", QA)
    run = tmp_path / "run"
    flags = dict(
        max_steps=6,
        save_steps=2,
        save_total_limit=1,
        learning_rate=1e-2,
        eval_dataset=[texts, qa],
        eval_max_new_tokens=6,
        metric_for_best_model="eval/texts/perplexity",
    )
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, run, **flags)) == 0
    rows = eval_rows(run)
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert {"eval/qa/rouge_l", "eval/qa/exact_match", "eval/texts/nll_per_token"} <= set(rows[0])
    values = {r["step"]: r["eval/texts/perplexity"] for r in rows}
    best_step = min(values, key=values.get)  # lower perplexity is better by default
    best = json.loads((run / "best_checkpoint.json").read_text())
    assert best["step"] == best_step and best["value"] == values[best_step]  # the same number
    assert best["greater_is_better"] is False
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == sorted({f"step-{best_step}", "step-6"})
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best_checkpoint"].endswith(f"checkpoints/step-{best_step}")
    assert "eval/texts/perplexity" in (run / "report.html").read_text()


def test_resume_remembers_the_best_step(tiny_model_dir, chat_jsonl, tmp_path):
    texts = write_jsonl(tmp_path / "texts.jsonl", TEXTS)
    flags = dict(
        save_steps=2,
        learning_rate=1e-2,
        eval_dataset=texts,
        metric_for_best_model="eval/texts/nll_per_token",
    )
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, straight, max_steps=6, **flags)) == 0
    # The straight run as it was after its step-4 save: resuming from there must end with the
    # same best step, although the evaluations before step 4 are not run again.
    shutil.copytree(straight, resumed)
    for leftover in ("checkpoints/step-6", "final"):
        shutil.rmtree(resumed / leftover)
    (resumed / "best_checkpoint.json").unlink()
    argv = tiny_sft(tiny_model_dir, chat_jsonl, resumed, max_steps=6, **flags)
    assert main([*argv, "--resume_from_checkpoint", "auto"]) == 0
    best = json.loads((straight / "best_checkpoint.json").read_text())
    assert json.loads((resumed / "best_checkpoint.json").read_text()) == best
    assert best["step"] in (2, 4)  # else the test shows nothing: step 6 is evaluated again


@pytest.mark.bad_input(
    input="`--metric_for_best_model` that no evaluation logs, or without any evaluation",
    outcome="Error naming the metric and the evaluated values (or the flags that evaluate)",
)
def test_unknown_best_metric_is_named(tiny_model_dir, chat_jsonl, tmp_path, capsys):
    texts = write_jsonl(tmp_path / "texts.jsonl", TEXTS)
    argv = tiny_sft(
        tiny_model_dir,
        chat_jsonl,
        tmp_path / "a",
        max_steps=2,
        save_steps=2,
        eval_dataset=texts,
        metric_for_best_model="eval/texts/accuracy",
    )
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "--metric_for_best_model eval/texts/accuracy: not among the evaluated values" in error
    assert "eval/texts/perplexity" in error
    argv = tiny_sft(
        tiny_model_dir, chat_jsonl, tmp_path / "b", max_steps=2, metric_for_best_model="eval_loss"
    )
    assert main(argv) == 2
    assert "needs evaluations to compare" in capsys.readouterr().err


def test_generation_evaluation_needs_the_whole_model_on_rank_0():
    from swiftlm.distributed.mesh import ParallelDims
    from swiftlm.train.evaluation import whole_model_on_each_rank

    class Fake:
        def __init__(self, dims):
            self.dims = dims

    assert whole_model_on_each_rank(Fake(ParallelDims(pp=1, dp=2, tp=1, data_parallel="ddp")))
    assert not whole_model_on_each_rank(Fake(ParallelDims(pp=1, dp=2, tp=1, data_parallel="fsdp2")))
    assert not whole_model_on_each_rank(Fake(ParallelDims(pp=1, dp=1, tp=2, data_parallel="ddp")))
    assert not whole_model_on_each_rank(object())  # DeepSpeed: no mesh of swiftlm's


@pytest.mark.numerics
def test_ddp_ranks_agree_on_the_scores_and_the_best_step(tiny_model_dir, chat_jsonl, tmp_path):
    """Rank 0 generates and sends the scores; both ranks pick the same best checkpoint, and the
    scores equal a single process's (DDP trains the same weights)."""
    texts = write_jsonl(tmp_path / "texts.jsonl", TEXTS)
    qa = write_jsonl(tmp_path / "qa.jsonl", QA)
    flags = dict(
        max_steps=4,
        save_steps=2,
        lora_dropout=0,
        learning_rate=1e-2,
        eval_dataset=[texts, qa],
        eval_max_new_tokens=6,
        metric_for_best_model="eval/texts/nll_per_token",
    )
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    assert (
        main(tiny_sft(tiny_model_dir, chat_jsonl, single, per_device_train_batch_size=2, **flags))
        == 0
    )
    argv = tiny_sft(tiny_model_dir, chat_jsonl, ddp, per_device_train_batch_size=1, **flags)
    assert main([*argv, "--nproc_per_node", "2", "--master_port", "29961"]) == 0
    # A mean NLL per token behind the forward of rows shorter than 64 tokens, and the
    # all-reduce of two ranks' sums.
    terms = forward_terms(tokens=64) + 2
    for a, b in zip(eval_rows(single), eval_rows(ddp), strict=True):
        key = "eval/texts/nll_per_token"
        assert_close(b[key], a[key], terms=terms, what=f"step {a['step']} {key}")
    assert (
        json.loads((ddp / "best_checkpoint.json").read_text())["step"]
        == json.loads((single / "best_checkpoint.json").read_text())["step"]
    )


@pytest.mark.bad_input(
    input="`--eval_dataset` when training a reward model (`swiftlm rlhf --rlhf_type rm`)",
    outcome="Error before training: a score head generates no text; what it is validated on",
)
def test_reward_models_are_not_given_generation_tasks(tiny_model_dir, tmp_path, capsys):
    pairs = [{"prompt": "Hi", "chosen": "Hello! How can I help?", "rejected": "Go."}] * 4
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    texts = write_jsonl(tmp_path / "texts.jsonl", TEXTS)
    argv = tiny_sft(tiny_model_dir, data, tmp_path / "rm", max_steps=1, eval_dataset=texts)
    argv[0:1] = ["rlhf", "--rlhf_type", "rm"]
    assert main(argv) == 2
    assert "trains a score head, which generates no text" in capsys.readouterr().err
