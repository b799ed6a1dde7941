"""`swiftlm rlhf --rlhf_type grpo` on a tiny model: the engine's log-probs equal the trainer's,
exact resume with pending completions, 2 gloo ranks equal one process, gradient accumulation,
failing reward functions that do not stop the run, what a run logs and writes, bad input."""

import json
import math
import os
import socket
from types import SimpleNamespace

import pytest
import torch

from conftest import logged, write_jsonl
from swiftlm.cli.main import main
from swiftlm.losses.causal_lm import shifted_labels, token_cross_entropy
from tolerance import (
    assert_close,
    assert_same_weights,
    assert_trained_weights_close,
    backward_terms,
    forward_terms,
)
from warm_launch import torchrun_script

ROWS = [{"prompt": f"What is {i} plus {i + 1}?", "solution": str(2 * i + 1)} for i in range(16)]
ADAPTER = "final/adapter_model.safetensors"
SHORT_REWARD = """
def short(prompts, completions, completion_ids, **kwargs):
    return [-len(ids) / 8 for ids in completion_ids]
"""
BAD_REWARDS = """
import time

def sleepy(prompts, completions, **kwargs):
    time.sleep(3600)

def broken(prompts, completions, **kwargs):
    raise RuntimeError("my reward has a bug")
"""


def loss_size(run_dir, beta: float = 0.04) -> float:
    """What a logged GRPO loss's rounding is relative to (tests/tolerance.py). On-policy (one
    optimizer step per generation) old_logps is logps.detach(), so the ratio is exp(0) = 1
    exactly and the loss is a normalized sum of the advantages, of either sign and a mean size
    of at most 1 (standardized within a group), plus beta times k3 = e^d - d - 1 per token,
    whose three terms add up to 2 + 2|d|, |d| about sqrt(2 kl)."""
    kl = max(logged(run_dir, "kl"))
    return 1 + beta * (2 + 2 * math.sqrt(2 * kl))


def grpo(model_dir, data, out, **flags) -> list[str]:
    defaults = {
        "rlhf_type": "grpo",
        "torch_dtype": "float32",
        "report_to": "none",
        "logging_steps": 1,
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_length": 64,
        "lora_dropout": 0,
    }
    argv = ["rlhf", "--model", str(model_dir), "--dataset", str(data), "--output_dir", str(out)]
    for name, value in {**defaults, **flags}.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        argv += [f"--{name}", *map(str, values)]
    return argv


@pytest.fixture
def prompts(tmp_path):
    return write_jsonl(tmp_path / "prompts.jsonl", ROWS)


@pytest.fixture
def short_reward(tmp_path):
    path = tmp_path / "short.py"
    path.write_text(SHORT_REWARD)
    return f"{path}:short"


@pytest.mark.numerics
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_engine_and_the_trainer_agree_on_the_sampled_tokens(tiny_model_dir, temperature):
    """The engine's log-probs (logprobs_mode scaled) of the tokens it sampled equal the
    trainer's forward log-probs of the same tokens under logits / temperature (fp32)."""
    from swiftlm.engine.protocol import GenerationRequest
    from swiftlm.methods.rl.rollout import PolicySampler, completion_rows, sampling_params
    from swiftlm.models.loader import load_model, load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = load_model(str(tiny_model_dir), torch.float32, torch.device("cpu"), "sdpa")
    args = SimpleNamespace(max_completion_length=12, temperature=temperature, top_p=1.0)
    prompts = [tokenizer(f"question {i} " * (i + 1))["input_ids"] for i in range(6)]
    sampler = PolicySampler(tokenizer, 128)
    try:
        results = sampler.generate(
            model,
            [GenerationRequest(p, sampling_params(args, 3, seed=i)) for i, p in enumerate(prompts)],
        )
    finally:
        sampler.close()
    samples = [s for group in results for s in group]
    batch = completion_rows(
        [p for p in prompts for _ in range(3)],
        [list(s.token_ids) for s in samples],
        [[lp.logprob for lp in s.logprobs] for s in samples],
        tokenizer.pad_token_id,
    )
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    trainer = -token_cross_entropy(logits / temperature, batch["labels"])
    mask = shifted_labels(batch["labels"]) != -100
    assert int(mask.sum()) == sum(len(s.token_ids) for s in samples) > 50
    # Decoding with a KV cache against one forward of whole rows: the same sums in another
    # order. A log-prob's rounding is relative to its size + 1 (the log of a sum >= 1).
    size = float(trainer[mask].abs().max()) + 1
    terms = forward_terms(batch["input_ids"].shape[1])
    engine = batch["engine_logps"][mask]
    assert_close(engine, trainer[mask], terms=terms, magnitude=size, what="log-probs")
    # Not trivially equal: log-probs at temperature 1 and 0.7 differ.
    other = -token_cross_entropy(logits / (1.7 - temperature), batch["labels"])
    assert float((other - batch["engine_logps"]).abs()[mask].mean()) > 1e-2


def _completion_layouts(model, samples, prompts) -> dict:
    """Per layout of the same sampled completions (padded rows; one packed row, each prompt
    once; one packed row, a segment per completion): GRPO's loss (beta 0.04 to the base
    model with the adapter off), the log-probs, the LoRA gradients and the batch."""
    from swiftlm.losses.rl import clipped_surrogate, k3_kl, reduce_tokens
    from swiftlm.methods.rl.packed_completions import packed_completion_row, packed_token_logps
    from swiftlm.methods.rl.rollout import completion_rows

    completions = [list(s.token_ids) for s in samples]
    padded = completion_rows(prompts, completions, [[0.0] * len(c) for c in completions], 0)
    mask = (shifted_labels(padded["labels"]) != -100).float()
    advantages = torch.linspace(-1, 1, len(samples))
    width = padded["input_ids"].shape[1]
    layouts = {"padded": padded}
    for name, share in (("shared", True), ("separate", False)):
        rest = {k: v for k, v in padded.items() if k not in ("input_ids", "attention_mask")}
        layouts[name] = {**rest, **packed_completion_row(prompts, completions, width, share)}

    def logps(module, batch):
        if "score_positions" in batch:
            return packed_token_logps(module, batch, 0.7)
        logits = module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return -token_cross_entropy(logits.logits / 0.7, batch["labels"])

    runs = {}
    for name, batch in layouts.items():
        model.zero_grad()
        policy = logps(model, batch)
        with torch.no_grad(), model.disable_adapter():
            reference = logps(model, batch)
        losses, _ = clipped_surrogate(
            policy, policy.detach(), advantages, mask, epsilon_low=0.2, epsilon_high=0.2
        )
        loss = reduce_tokens(losses + 0.04 * k3_kl(policy, reference), mask, "grpo")
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        runs[name] = (loss.item(), policy.detach(), grads, batch)
    return runs


@pytest.mark.numerics
def test_padding_free_completions_equal_padded_rows(tiny_model_dir):
    """A micro-batch's completions in one packed row (each prompt computed once, its other
    completions forks of it; or a segment per completion) give the padded rows' per-token
    log-probs, GRPO loss and LoRA gradients: the same sums in other orders. Without the
    varlen attention's forks the shared layout's completions lose their prompt and fail."""
    from peft import LoraConfig, get_peft_model

    from swiftlm.engine.protocol import GenerationRequest
    from swiftlm.methods.rl.rollout import PolicySampler, sampling_params
    from swiftlm.models.attention import VARLEN, register_varlen_attention
    from swiftlm.models.loader import load_model, load_tokenizer

    register_varlen_attention()
    tokenizer = load_tokenizer(str(tiny_model_dir))
    base = load_model(str(tiny_model_dir), torch.float32, torch.device("cpu"), VARLEN)
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = get_peft_model(base, lora)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # an adapter that changes the policy (B starts at 0)
            torch.nn.init.normal_(param, std=0.2)
    ids = [tokenizer(f"question {i} " * (2 * i + 1))["input_ids"] for i in range(2)]
    args = SimpleNamespace(max_completion_length=10, temperature=0.7, top_p=1.0)
    sampler = PolicySampler(tokenizer, 128)
    try:
        requests = [
            GenerationRequest(p, sampling_params(args, 3, seed=i)) for i, p in enumerate(ids)
        ]
        results = sampler.generate(model, requests)
    finally:
        sampler.close()
    samples = [s for group in results for s in group]
    prompts = [p for p in ids for _ in range(3)]
    model.train()
    runs = _completion_layouts(model, samples, prompts)
    loss, logps, grads, padded = runs["padded"]
    completion_tokens = sum(len(s.token_ids) for s in samples)
    assert int((logps != 0).sum()) == completion_tokens > 12
    size = float(logps.abs().max()) + 1
    terms = forward_terms(padded["input_ids"].shape[1])
    for name in ("shared", "separate"):
        other_loss, other_logps, other_grads, batch = runs[name]
        assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
        assert_close(other_logps, logps, terms=terms, magnitude=size, what=f"{name} log-probs")
        assert_close(other_loss, loss, terms=terms, magnitude=size, what=f"{name} loss")
        for ours, theirs in zip(other_grads, grads, strict=True):
            scale = theirs.abs().max().item()
            assert_close(ours, theirs, terms=backward_terms(64), magnitude=scale, what="grad")
    prompt_tokens = sum(len(p) for p in ids)
    assert runs["shared"][3]["input_ids"].shape[1] == prompt_tokens + completion_tokens
    assert runs["separate"][3]["input_ids"].shape[1] == 3 * prompt_tokens + completion_tokens


@pytest.mark.numerics
def test_sampling_on_merged_weights_equals_the_adapter_and_restores_the_base(tiny_model_dir):
    """Within merged_adapter_weights the adapter layers are off and each adapted Linear holds
    W + scale x B @ A: the logits equal the adapter's within rounding; afterwards every base
    weight is the very tensor it was, its values unchanged (no drift), the adapter on again.
    A DoRA adapter is left as it is."""
    from peft import LoraConfig, get_peft_model

    from swiftlm.methods.rl.merged_sampling import merged_adapter_weights
    from swiftlm.models.loader import load_model

    def policy(**lora):
        base = load_model(str(tiny_model_dir), torch.float32, torch.device("cpu"), "sdpa")
        torch.manual_seed(0)
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **lora)
        model = get_peft_model(base, config).eval()
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.2)
        return model

    model = policy()
    ids = torch.tensor([[5, 9, 13, 2, 7, 11, 3]])
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters() if "base_layer" in n}
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with merged_adapter_weights(model):
            layer = model.base_model.model.model.layers[0].self_attn.q_proj
            assert layer.disable_adapters
            merged = model(input_ids=ids).logits
            assert not any(layer.get_base_layer().weight is p for p, _ in before.values())
        after = dict(model.named_parameters())
    assert not model.base_model.model.model.layers[0].self_attn.q_proj.disable_adapters
    for name, (param, values) in before.items():
        assert after[name] is param and torch.equal(param, values), name
    size = float(adapted.abs().max())
    assert_close(merged, adapted, terms=forward_terms(7), magnitude=size, what="merged logits")
    dora = policy(use_dora=True)
    weight = dora.base_model.model.model.layers[0].self_attn.q_proj.get_base_layer().weight
    with merged_adapter_weights(dora):
        layer = dora.base_model.model.model.layers[0].self_attn.q_proj
        assert layer.get_base_layer().weight is weight and not layer.disable_adapters


def test_a_run_logs_rewards_and_writes_completions(tiny_model_dir, prompts, short_reward, tmp_path):
    out = tmp_path / "run"
    flags = dict(
        max_steps=8, learning_rate="3e-2", reward_funcs=[short_reward, "length"], beta=0.04
    )
    assert main(grpo(tiny_model_dir, prompts, out, **flags)) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = rows[0]
    for key in ("reward", "reward_std", "frac_reward_zero_std", "kl", "clip_ratio", "logprob_mismatch",
                f"rewards/{short_reward}/mean", "rewards/length/mean", "completions/mean_length"):  # fmt: skip
        assert key in first, key
    assert first["kl"] == 0  # the adapter starts as the identity: policy == reference
    # The logged mean of the engine/trainer gaps, which the test above bounds token by token
    # (a bound of about 3e-4 at |log-prob| 10): this only checks the metric is that gap.
    assert first["logprob_mismatch"] < 1e-3
    # The step-time breakdown separates sampling and scoring from the training forward.
    assert first["time/generation_s"] > 0 and first["time/reward_s"] > 0
    assert sum(v for k, v in first.items() if k.startswith("share/")) == pytest.approx(1, abs=1e-3)
    lengths = logged(out, "completions/mean_length")
    assert sum(lengths[-3:]) / 3 < sum(lengths[:3]) / 3  # the "short" reward is learned
    completions = [
        json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()
    ]
    assert len(completions) == 8 * 8  # 8 steps x 2 prompts x 4 completions
    assert {"prompt", "completion", "rewards", "reward", "advantage", "step"} <= completions[
        0
    ].keys()
    config = (out / "config.yaml").read_text()
    assert "rlhf_type: grpo" in config and "temperature: 1.0" in config and "beta: 0.04" in config


class Crash(Exception):
    pass


@pytest.mark.numerics
def test_a_crashed_run_resumed_equals_an_uninterrupted_one(
    tiny_model_dir, prompts, short_reward, tmp_path, monkeypatch, capsys
):
    """6 steps, 2 optimizer steps per generation, a checkpoint at step 3: the resumed run
    trains step 4 on the completions sampled at step 3 (saved with the checkpoint)."""
    from swiftlm.methods.rl.grpo import GRPO

    flags = dict(
        max_steps=6, save_steps=3, steps_per_generation=2, learning_rate="3e-2",
        reward_funcs=short_reward,
    )  # fmt: skip
    assert main(grpo(tiny_model_dir, prompts, tmp_path / "straight", **flags)) == 0
    real_loss, calls = GRPO.loss, {"n": 0}

    def crashing_loss(self, model, batch):
        calls["n"] += 1
        if calls["n"] == 4:
            raise Crash  # killed during step 4, after the step-3 checkpoint
        return real_loss(self, model, batch)

    monkeypatch.setattr(GRPO, "loss", crashing_loss)
    with pytest.raises(Crash):
        main(grpo(tiny_model_dir, prompts, tmp_path / "resumed", **flags))
    monkeypatch.setattr(GRPO, "loss", real_loss)
    resumed = grpo(tiny_model_dir, prompts, tmp_path / "resumed", **flags)
    assert main([*resumed, "--resume_from_checkpoint", "auto"]) == 0
    assert "resumed from" in capsys.readouterr().out
    # The same arithmetic on the same machine and shapes: bit for bit.
    assert_same_weights(tmp_path / "straight" / ADAPTER, tmp_path / "resumed" / ADAPTER)
    for key in ("loss", "reward", "clip_ratio"):
        straight = logged(tmp_path / "straight", key)[-3:]
        assert logged(tmp_path / "resumed", key)[-3:] == straight, key
    # The completions of the crashed generation were written again, not twice.
    lines = (tmp_path / "resumed" / "completions.jsonl").read_text().splitlines()
    assert len(lines) == len((tmp_path / "straight" / "completions.jsonl").read_text().splitlines())
    # One generation per 2 optimizer steps: sampled at steps 1, 3 and 5.
    assert {json.loads(line)["step"] for line in lines} == {1, 3, 5}


@pytest.mark.numerics
def test_accumulating_2_micro_batches_equals_1_batch(
    tiny_model_dir, prompts, short_reward, tmp_path
):
    common = dict(max_steps=3, learning_rate="3e-2", reward_funcs=short_reward, loss_type="dapo")
    one = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1)
    two = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert main(grpo(tiny_model_dir, prompts, tmp_path / "one", **common, **one)) == 0
    assert main(grpo(tiny_model_dir, prompts, tmp_path / "two", **common, **two)) == 0
    one, two = tmp_path / "one" / ADAPTER, tmp_path / "two" / ADAPTER
    assert_trained_weights_close(one, two, learning_rate=3e-2, steps=3)
    size, terms = loss_size(tmp_path / "one"), forward_terms(64)  # rows of at most 64 tokens
    assert_close(logged(tmp_path / "two"), logged(tmp_path / "one"), terms=terms, magnitude=size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.numerics
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_two_gloo_ranks_equal_one_process(engine, tiny_model_dir, prompts, short_reward, tmp_path):
    """Each rank samples its own prompts; the seeds follow the prompt, so the completions, the
    advantages (scale_rewards batch: the std over both ranks) and the weights are those of one
    process with the whole batch. FSDP2 samples in lockstep (every rank decodes
    --max_completion_length tokens, cut after the first stop token): the same completions."""
    common = dict(
        max_steps=3, learning_rate="3e-2", reward_funcs=short_reward, scale_rewards="batch"
    )
    assert main(grpo(tiny_model_dir, prompts, tmp_path / "single", **common)) == 0
    sharding = {"fsdp": "fsdp2"} if engine == "fsdp2" else {}
    out = tmp_path / engine
    argv = grpo(tiny_model_dir, prompts, out, **common, **sharding, per_device_train_batch_size=4)
    # torchrun's own agent (not swiftlm's launcher), in this process (tests/warm_launch.py)
    torchrun = [
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        "-m",
        "swiftlm.cli.main",
    ]
    torchrun_script([*torchrun, *argv], env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    single = tmp_path / "single" / ADAPTER
    assert_trained_weights_close(single, out / ADAPTER, learning_rate=3e-2, steps=3)
    # The same completions: their rewards (multiples of 1/8) and lengths average exactly.
    for key in ("reward", "completions/mean_length"):
        assert logged(out, key) == logged(tmp_path / "single", key), key


def test_a_hanging_and_a_raising_reward_are_counted_and_the_run_goes_on(
    tiny_model_dir, prompts, tmp_path, capsys
):
    path = tmp_path / "bad_rewards.py"
    path.write_text(BAD_REWARDS)
    out = tmp_path / "run"
    funcs = [f"{path}:sleepy", f"{path}:broken", "length"]
    assert (
        main(grpo(tiny_model_dir, prompts, out, max_steps=2, reward_funcs=funcs, reward_timeout=1))
        == 0
    )
    printed = capsys.readouterr().out
    assert "timed out after 1 s (--reward_timeout)" in printed
    assert "RuntimeError: my reward has a bug" in printed
    assert logged(out, f"rewards/{path}:sleepy/failures") == [8.0, 8.0]
    assert logged(out, f"rewards/{path}:broken/failures") == [8.0, 8.0]
    assert (out / "final").is_dir()


@pytest.mark.bad_input(
    input="`swiftlm rlhf --rlhf_type grpo --per_device_train_batch_size` not a multiple of "
    "--num_generations",
    outcome="Error: the batch size counts completions (as TRL and ms-swift), with a value to use",
)
def test_a_batch_that_splits_a_group_is_refused(tiny_model_dir, prompts, tmp_path, capsys):
    assert main(grpo(tiny_model_dir, prompts, tmp_path / "x", per_device_train_batch_size=6)) == 2
    assert "must be a multiple of --num_generations 4" in capsys.readouterr().err


@pytest.mark.bad_input(
    input="`swiftlm rlhf --rlhf_type grpo --infer_backend vllm` with what one colocated vLLM "
    "engine cannot follow: several ranks, DoRA, a quantized base",
    outcome="Exit 2 before anything loads, naming the flag and --infer_backend pt",
)
@pytest.mark.parametrize(
    "flags",
    [{"nproc_per_node": 2}, {"train_type": "dora"}, {"quant_method": "bnb", "quant_bits": 4}],
)
def test_what_vllm_rollouts_cannot_follow_is_refused(
    tiny_model_dir, prompts, tmp_path, capsys, flags
):
    argv = grpo(tiny_model_dir, prompts, tmp_path / "x", infer_backend="vllm", **flags)
    assert main(argv) == 2
    err = capsys.readouterr().err
    flag = next(iter(flags))
    assert f"--{flag} " in err and "not available with --infer_backend vllm" in err
    assert "use --infer_backend pt" in err


@pytest.mark.bad_input(
    input="`swiftlm rlhf --rlhf_type grpo` with a --vllm_* flag but without --infer_backend vllm",
    outcome="Exit 2 before anything loads, naming the flag and --infer_backend vllm",
)
def test_a_vllm_flag_without_the_vllm_backend_is_refused(tiny_model_dir, prompts, tmp_path, capsys):
    assert main(grpo(tiny_model_dir, prompts, tmp_path / "x", vllm_mode="server")) == 2
    assert "--vllm_mode server: only with --infer_backend vllm" in capsys.readouterr().err


@pytest.mark.bad_input(
    input="`swiftlm rlhf --rlhf_type grpo --vllm_mode server` where no `swiftlm rollout` "
    "server answers",
    outcome="Exit 2 after --vllm_server_timeout, naming the address and the command that "
    "starts a server",
)
def test_a_missing_rollout_server_is_named(tiny_model_dir, prompts, tmp_path, capsys):
    from serve_helpers import free_port

    port = free_port()
    flags = {"infer_backend": "vllm", "vllm_mode": "server", "vllm_server_port": port}
    argv = grpo(tiny_model_dir, prompts, tmp_path / "x", vllm_server_timeout=1, **flags)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--vllm_server_port {port}: no rollout server answers /health" in err
    assert "start one with `swiftlm rollout --model" in err


@pytest.mark.bad_input(
    input="A GRPO prompt row without a prompt (`messages`, `prompt`, `query` ...)",
    outcome="Error naming file:line and the accepted layouts",
)
def test_a_row_without_a_prompt_is_refused_by_line(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "bad.jsonl", [*ROWS[:3], {"question": "x", "solution": "1"}])
    assert main(grpo(tiny_model_dir, data, tmp_path / "x", max_steps=1)) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl:4" in err and "no prompt" in err


@pytest.mark.bad_input(
    input="`swiftlm rlhf --rlhf_type grpo`: a rollout sample that fails inside the engine",
    outcome="The run stops with an error naming the prompt and the sample and why (the "
    "engine logged it); the rest of the batch was still generated",
)
def test_a_rollout_sample_that_fails_names_its_prompt(
    tiny_model_dir, prompts, tmp_path, capsys, monkeypatch
):
    from swiftlm.engine import scheduler

    accept = scheduler.Sequence.accept
    failed: list[str] = []

    def failing_accept(seq, token, logprob):
        # The last sample of the first group the engine decodes fails, mid-answer.
        if seq.index == 3 and len(seq.row.output_ids) == 2 and not failed:
            failed.append(seq.detokenizer.tokenizer.decode(seq.row.prompt_ids))
            raise RuntimeError("sampling broke")
        return accept(seq, token, logprob)

    monkeypatch.setattr(scheduler.Sequence, "accept", failing_accept)
    assert main(grpo(tiny_model_dir, prompts, tmp_path / "run", max_steps=1)) == 1
    error = " ".join(capsys.readouterr().err.split())
    question = next(row["prompt"] for row in ROWS if row["prompt"] in failed[0])
    assert "sampling completions failed for 1 of 2 prompts" in error
    assert "sample 3 of the prompt" in error and question in error
    assert "RuntimeError: sampling broke" in error
