"""`swiftlm rlhf --rlhf_type gkd` on tiny models (the teacher: the tiny Llama with another
seed): the step's loss equals the JSD written out per element, beta 0 is forward KL, a short
run moves the student to the teacher, lmbda 0 trains on the dataset's answers without
sampling and lmbda 1 samples every step, seq_kd samples the teacher, exact resume, bad input."""

import math
import os

import pytest
import torch

from conftest import build_tiny_llama, build_tokenizer, logged, write_jsonl
from swiftlm.cli.main import main
from tolerance import assert_close, assert_same_weights, assert_trained_weights_close, forward_terms
from warm_launch import torchrun_script

ADAPTER = "final/adapter_model.safetensors"
ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"What is {i} plus {i + 1}?"},
            {"role": "assistant", "content": f"The answer is {2 * i + 1}."},
        ]
    }
    for i in range(16)
]


def gkd(model_dir, teacher, data, out, **flags) -> list[str]:
    defaults = {
        "rlhf_type": "gkd",
        "teacher_model": teacher,
        "torch_dtype": "float32",
        "report_to": "none",
        "logging_steps": 1,
        "per_device_train_batch_size": 4,
        "max_completion_length": 8,
        "max_length": 64,
        "lora_dropout": 0,
        "seed": 7,
    }
    argv = ["rlhf", "--model", str(model_dir), "--dataset", str(data), "--output_dir", str(out)]
    for name, value in {**defaults, **flags}.items():
        argv += [f"--{name}", str(value)]
    return argv


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """The tiny Llama's architecture and tokenizer with other (seed 1) weights."""
    out = tmp_path_factory.mktemp("teacher")
    build_tiny_llama(out, vocab_size=len(build_tokenizer(out)), seed=1)
    return out


@pytest.fixture
def answers(tmp_path):
    return write_jsonl(tmp_path / "answers.jsonl", ROWS)


class Recorder:
    """Wraps PolicySampler.generate and GKD.step_batches to see what a run sampled and
    trained on."""

    def __init__(self, monkeypatch):
        from swiftlm.methods.rl.gkd import GKD
        from swiftlm.methods.rl.rollout import PolicySampler

        self.models, self.steps = [], []
        generate, step_batches = PolicySampler.generate, GKD.step_batches

        def recording_generate(sampler, model, requests):
            self.models.append(type(model).__name__)
            return generate(sampler, model, requests)

        def recording_step_batches(method, model, context):
            batches = step_batches(method, model, context)
            self.steps.append([{k: v.clone() for k, v in b.items()} for b in batches])
            return batches

        monkeypatch.setattr(PolicySampler, "generate", recording_generate)
        monkeypatch.setattr(GKD, "step_batches", recording_step_batches)


def _plain_jsd(student, teacher, beta, temperature, top_k=None):
    """Per position, in float64 with plain probabilities: beta 0 KL(T||S), else the mixture;
    with top_k, both renormalized on the teacher's top_k tokens."""
    if top_k is not None:
        chosen = teacher.topk(top_k, dim=-1).indices
        student, teacher = student.gather(-1, chosen), teacher.gather(-1, chosen)
    p_s = torch.softmax(student.double() / temperature, -1)
    p_t = torch.softmax(teacher.double() / temperature, -1)
    if beta == 0:
        return (p_t * (p_t.log() - p_s.log())).sum(-1)
    m = beta * p_t + (1 - beta) * p_s
    return beta * (p_t * (p_t / m).log()).sum(-1) + (1 - beta) * (p_s * (p_s / m).log()).sum(-1)


@pytest.mark.numerics
@pytest.mark.parametrize(("beta", "top_k"), [(0.0, None), (0.5, None), (0.5, 5)])
def test_the_step_loss_is_the_jsd_per_completion_token(
    tiny_model_dir, teacher, answers, tmp_path, monkeypatch, beta, top_k
):
    """Step 1 (the LoRA student is still the base model), 2 micro-batches: the logged loss is
    the sum of the per-token JSD over both, divided by their completion tokens."""
    from swiftlm.models.loader import load_model

    record = Recorder(monkeypatch)
    out = tmp_path / "run"
    flags = dict(max_steps=1, beta=beta, lmbda=0.5, gradient_accumulation_steps=2)
    if top_k:
        flags["gkd_logits_topk"] = top_k
    assert main(gkd(tiny_model_dir, teacher, answers, out, **flags)) == 0
    cpu = torch.device("cpu")
    models = [load_model(str(d), torch.float32, cpu, "sdpa") for d in (tiny_model_dir, teacher)]
    total, tokens, size = 0.0, 0, 0.0
    for batch in record.steps[0]:
        with torch.no_grad():
            s, t = (
                m(batch["input_ids"], attention_mask=batch["attention_mask"]).logits for m in models
            )
        mask = batch["labels"][:, 1:] != -100  # position i predicts token i + 1
        total += float(_plain_jsd(s[:, :-1], t[:, :-1], beta, 0.9, top_k)[mask].sum())
        tokens += int(mask.sum())
        size = max(size, s.abs().max().item(), t.abs().max().item())
    assert len(record.steps[0]) == 2 and tokens > 20
    # The JSD changes by at most log 2 per unit change of a logit, so its rounding is the
    # logits' (magnitude: the largest logit), through the forward's chain of sums.
    terms = forward_terms(tokens=64)  # every conversation here is under 64 tokens
    bound_scale = math.log(2) * size
    assert_close(logged(out)[0], total / tokens, terms=terms, magnitude=bound_scale)


def test_a_short_run_moves_the_student_to_the_teacher(tiny_model_dir, teacher, answers, tmp_path):
    """The JSD on the answers (eval_loss) falls; on-policy steps follow the (seed, step) draw."""
    from swiftlm.methods.rl.gkd import on_policy_step

    out = tmp_path / "run"
    flags = dict(max_steps=8, learning_rate="1e-2", train_type="full", eval_steps=1)
    flags["val_dataset"] = answers
    assert main(gkd(tiny_model_dir, teacher, answers, out, **flags)) == 0
    evals = logged(out, "eval_loss")
    assert evals[-1] < 0.6 * evals[0], evals  # measured: 0.12 after step 1, 0.057 at step 8
    drawn = [1.0 if on_policy_step(7, step, 0.5) else 0.0 for step in range(1, 9)]
    assert logged(out, "on_policy") == drawn and 0 < sum(drawn) < 8


def test_lmbda_0_trains_on_the_answers_without_sampling(
    tiny_model_dir, teacher, answers, tmp_path, monkeypatch, tiny_tokenizer
):
    record = Recorder(monkeypatch)
    out = tmp_path / "run"
    flags = dict(max_steps=4, lmbda=0, max_completion_length=16)
    assert main(gkd(tiny_model_dir, teacher, answers, out, **flags)) == 0
    assert record.models == [] and logged(out, "on_policy") == [0.0] * 4
    # Each completion is the answer's tokens and the end-of-turn token, as SFT trains them.
    for batch in [b for step in record.steps for b in step]:
        for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
            answer = tiny_tokenizer.decode(ids[labels != -100])
            assert answer.startswith("The answer is ") and answer.endswith(".<|im_end|>")
    lengths = [float((b["labels"] != -100).sum()) / 4 for step in record.steps for b in step]
    assert logged(out, "completions/mean_length") == pytest.approx(lengths)


def test_lmbda_1_samples_the_student_every_step(
    tiny_model_dir, teacher, answers, tmp_path, monkeypatch
):
    record = Recorder(monkeypatch)
    out = tmp_path / "run"
    assert main(gkd(tiny_model_dir, teacher, answers, out, max_steps=3, lmbda=1)) == 0
    assert record.models == ["PeftModelForCausalLM"] * 3  # the LoRA student, once per step
    assert logged(out, "on_policy") == [1.0] * 3
    assert all(1 <= length <= 8 for length in logged(out, "completions/mean_length"))


def test_seq_kd_trains_on_the_teachers_samples_and_needs_no_answers(
    tiny_model_dir, teacher, tmp_path, monkeypatch
):
    questions = [{"prompt": row["messages"][0]["content"]} for row in ROWS]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", questions)
    record = Recorder(monkeypatch)
    out = tmp_path / "run"
    flags = dict(max_steps=2, lmbda=0, seq_kd="true")
    assert main(gkd(tiny_model_dir, teacher, prompts, out, **flags)) == 0
    assert record.models == ["LlamaForCausalLM"] * 2  # the frozen teacher samples
    assert logged(out, "on_policy") == [0.0, 0.0]


@pytest.mark.numerics
def test_two_gloo_ranks_equal_one_process(tiny_model_dir, teacher, answers, tmp_path):
    """Every rank takes the same on-policy draw, samples its own prompts with seeds that follow
    the prompt, and the loss is normalized by the completion tokens of both ranks."""
    common = dict(max_steps=4, learning_rate="3e-2", lmbda=0.5)  # on-policy at step 4 only
    assert main(gkd(tiny_model_dir, teacher, answers, tmp_path / "single", **common)) == 0
    argv = gkd(tiny_model_dir, teacher, answers, tmp_path / "ddp", **common)
    argv[argv.index("--per_device_train_batch_size") + 1] = "2"
    # torchrun's own agent (not swiftlm's launcher), in this process (tests/warm_launch.py)
    torchrun = ["--nproc_per_node", "2", "--master_port", "29851", "-m", "swiftlm.cli.main"]
    torchrun_script([*torchrun, *argv], env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    a, b = tmp_path / "single" / ADAPTER, tmp_path / "ddp" / ADAPTER
    assert_trained_weights_close(a, b, learning_rate=3e-2, steps=4)
    # Sampling must not depend on the layout: the same draws and the same completions.
    for key in ("on_policy", "completions/mean_length"):
        assert logged(tmp_path / "ddp", key) == logged(tmp_path / "single", key), key
    terms = forward_terms(tokens=64) + 2  # + the all-reduce of two ranks' sums
    assert_close(logged(tmp_path / "ddp"), logged(tmp_path / "single"), terms=terms, what="loss")
    assert logged(tmp_path / "single", "on_policy") == [0.0, 0.0, 0.0, 1.0]


class Crash(Exception):
    pass


def test_a_crashed_run_resumed_equals_an_uninterrupted_one(
    tiny_model_dir, teacher, answers, tmp_path, monkeypatch, capsys
):
    from swiftlm.methods.rl.gkd import GKD

    flags = dict(max_steps=6, save_steps=3, learning_rate="3e-2", lmbda=0.5)
    assert main(gkd(tiny_model_dir, teacher, answers, tmp_path / "straight", **flags)) == 0
    real_loss, calls = GKD.loss, {"n": 0}

    def crashing_loss(self, model, batch):
        calls["n"] += 1
        if calls["n"] == 5:
            raise Crash  # killed during step 5, after the step-3 checkpoint
        return real_loss(self, model, batch)

    monkeypatch.setattr(GKD, "loss", crashing_loss)
    with pytest.raises(Crash):
        main(gkd(tiny_model_dir, teacher, answers, tmp_path / "resumed", **flags))
    monkeypatch.setattr(GKD, "loss", real_loss)
    resumed = gkd(tiny_model_dir, teacher, answers, tmp_path / "resumed", **flags)
    assert main([*resumed, "--resume_from_checkpoint", "auto"]) == 0
    assert "resumed from" in capsys.readouterr().out
    # The same arithmetic on the same shapes after the restart: bit for bit.
    assert_same_weights(tmp_path / "straight" / ADAPTER, tmp_path / "resumed" / ADAPTER)
    for key in ("loss", "on_policy", "completions/mean_length"):
        straight = logged(tmp_path / "straight", key)[-3:]
        assert logged(tmp_path / "resumed", key)[-3:] == straight, key
    assert 0 < sum(logged(tmp_path / "straight", "on_policy")) < 6  # both kinds of step


@pytest.mark.bad_input(
    input="`swiftlm rlhf --rlhf_type gkd --teacher_model` with another vocabulary size",
    outcome="Error naming --teacher_model and both vocabulary sizes, before its weights load",
)
def test_a_teacher_with_another_vocabulary_is_refused(tiny_model_dir, answers, tmp_path, capsys):
    other = tmp_path / "other"
    build_tiny_llama(other, vocab_size=len(build_tokenizer(other)) + 8, seed=1)
    assert main(gkd(tiny_model_dir, other, answers, tmp_path / "x", max_steps=1)) == 2
    err = capsys.readouterr().err
    assert f"--teacher_model {other}: its vocabulary has" in err and "same model family" in err


@pytest.mark.bad_input(
    input="A GKD row without a reference answer while --lmbda < 1 and no --seq_kd",
    outcome="Error naming file:line, with the fixes (an answer, --lmbda 1 or --seq_kd)",
)
def test_a_row_without_an_answer_is_refused_unless_every_step_samples(
    tiny_model_dir, teacher, tmp_path, capsys
):
    rows = [*ROWS[:3], {"messages": [{"role": "user", "content": "No answer here?"}]}]
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    assert main(gkd(tiny_model_dir, teacher, data, tmp_path / "x", max_steps=1)) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl:4" in err and "no reference answer" in err and "--lmbda 1" in err
    assert main(gkd(tiny_model_dir, teacher, data, tmp_path / "y", max_steps=1, lmbda=1)) == 0
    assert logged(tmp_path / "y", "on_policy") == [1.0]
