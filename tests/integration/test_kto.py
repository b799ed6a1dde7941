"""`swiftlm rlhf --rlhf_type kto` on a tiny model: the loss of a batch against the formula over
separate forwards (with TRL's mismatched-pair KL estimate), exact accumulation where the loss
has no per-micro-batch estimate, the row layouts and their errors, and a short run that
raises the desirable answers' log-probs."""

import math

import pytest
import torch
from test_dpo import ROWS as PAIRS
from test_dpo import _nothing, assert_packed_runs_equal_padded, layout_runs, rlhf

from conftest import logged, write_jsonl
from swiftlm.cli.main import main
from swiftlm.data.encode import IGNORE_INDEX
from tolerance import assert_close, assert_same_weights, backward_terms, forward_terms

ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Question number {i}?"},
            {"role": "assistant", "content": f"Answer number {i} is {i * 7}."},
        ],
        "label": True,
    }
    if i % 2 == 0
    else {"prompt": f"Question number {i}?", "completion": f"No idea about {i}.", "label": False}
    for i in range(16)
]
ADAPTER = "final/adapter_model.safetensors"


@pytest.fixture
def answers(tmp_path):
    return write_jsonl(tmp_path / "answers.jsonl", ROWS)


def method_and_model(model_dir, flags: dict, rows=ROWS[:4], seed: int = 0):
    """(method, encoded samples, a LoRA model with random adapter weights) for `flags`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftlm.config import RLHFConfig
    from swiftlm.config.parse import from_flat_dict
    from swiftlm.methods.registry import METHODS

    flat = {"rlhf_type": "kto", "per_device_train_batch_size": 4, **flags, "max_length": 64}
    cfg = from_flat_dict(RLHFConfig, flat)
    method = METHODS["kto"](cfg, AutoTokenizer.from_pretrained(model_dir))
    samples = method.encode([method.to_sample(row) for row in rows]).samples
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return method, samples, get_peft_model(base, lora)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


@pytest.mark.numerics
@pytest.mark.parametrize(
    "loss_type, lora_sign", [("kto", 1), ("kto", -1), ("apo_zero_unpaired", 1)]
)
def test_the_loss_of_a_batch_equals_an_independent_computation(
    loss_type, lora_sign, tiny_model_dir
):
    """Log-probs from one unpadded forward per (prompt, answer) with transformers, the
    reference with peft's adapter disabled, the KL pairs built by hand, KTO's formula. The
    random adapter gives a negative KL estimate (clamped to 0); negated, a positive one."""
    from swiftlm.methods.base import Layout

    flags = {"beta": 0.3, "loss_type": loss_type, "desirable_weight": 1.5}
    method, samples, model = method_and_model(tiny_model_dir, flags)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.mul_(lora_sign)
    batch = method.collate(Layout([[s] for s in samples], False))
    loss, metrics = method.loss(model, batch)

    def logp(prompt: dict, answer: dict, adapter: bool) -> float:
        ids = prompt["prompt_ids"] + answer["completion_ids"]
        labels = [IGNORE_INDEX] * len(prompt["prompt_ids"]) + answer["completion_labels"]
        with torch.no_grad(), model.disable_adapter() if not adapter else _nothing():
            logits = model(torch.tensor([ids])).logits[0].double()
        logps = torch.log_softmax(logits, -1)
        return sum(
            logps[t - 1, ids[t]].item() for t in range(1, len(ids)) if labels[t] != IGNORE_INDEX
        )

    n = len(samples)
    gaps = [
        logp(samples[(i + 1) % n], samples[i], True) - logp(samples[(i + 1) % n], samples[i], False)
        for i in range(n)
    ]
    z = max(0.0, sum(gaps) / n) if loss_type == "kto" else 0.0
    assert (sum(gaps) > 0) == (lora_sign < 0)  # both sides of the clamp are exercised
    expected, rewards_chosen = 0.0, 0.0
    for s in samples:
        u = logp(s, s, True) - logp(s, s, False)
        if loss_type == "kto":
            one = (
                1.5 * (1 - sigmoid(0.3 * (u - z))) if s["desirable"] else 1 - sigmoid(0.3 * (z - u))
            )
        else:
            one = 1.5 * (1 - sigmoid(0.3 * u)) if s["desirable"] else sigmoid(0.3 * u)
        expected += one
        rewards_chosen += 0.3 * u if s["desirable"] else 0.0
    # Batched forwards against separate ones: each value is a sigmoid (slope <= 1/4, weights
    # <= 1.5) or a beta-scaled sum of differences of summed log-probs, whose rounding is that
    # of the log-probs: sums over answers of a few tokens, each behind the model's forward.
    size = sum(abs(logp(s, s, True)) + abs(logp(s, s, False)) for s in samples)
    terms = forward_terms(tokens=64)  # every row here is shorter than 64 tokens
    assert_close(loss, expected, terms=terms, magnitude=size, what="loss")
    assert_close(metrics["rewards/chosen"], rewards_chosen, terms=terms, magnitude=size)
    assert_close(metrics["kl"], z * n, terms=terms, magnitude=size, what="kl")
    assert metrics["count/chosen"].item() == 2 and method.normalizer(batch) == 4


@pytest.mark.numerics
@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_padding_free_rows_equal_padded_rows(loss_type, tiny_model_dir):
    """The matched rows in one packed row and the mismatched (KL) rows in another (and two
    rows each under --packing) give the padded rows' loss, metrics and LoRA gradients."""
    method, samples, model = method_and_model(tiny_model_dir, {"loss_type": loss_type})
    runs = layout_runs(method, model, samples)
    metrics = runs["padded"][1]
    size = abs(metrics["logps/chosen"].item()) + abs(metrics["logps/rejected"].item())
    assert_packed_runs_equal_padded(runs, ("logps/chosen", "logps/rejected", "kl"), size)
    assert ("kl_input_ids" in runs["padding_free"][3]) == (loss_type == "kto")


@pytest.mark.numerics
def test_accumulating_4_micro_batches_of_1_equals_1_batch_of_4(tiny_model_dir, answers, tmp_path):
    """Exact for apo_zero_unpaired. kto's KL reference point is an estimate per micro-batch
    (its mismatched pairs are built inside each micro-batch, as TRL's), so another split gives
    other pairs and another estimate: 4 x 1 is refused for kto, and 2 x 2 differs from 1 x 4."""
    common = dict(max_steps=3, learning_rate="5e-3", lora_dropout=0)
    common |= dict(rlhf_type="kto", loss_type="apo_zero_unpaired")
    runs = {
        "one": dict(per_device_train_batch_size=4, gradient_accumulation_steps=1),
        "four": dict(per_device_train_batch_size=1, gradient_accumulation_steps=4),
    }
    for name, flags in runs.items():
        assert main(rlhf(tiny_model_dir, answers, tmp_path / name, **common, **flags)) == 0
    # The same sums over other batch shapes: equal up to their rounding. The loss and rewards
    # are beta-scaled differences of the summed log-probs, so their rounding is the log-probs'.
    size = max(map(abs, logged(tmp_path / "one", "logps/rejected")))
    for key in ("loss", "rewards/chosen", "logps/rejected", "count/chosen"):
        one, four = logged(tmp_path / "one", key), logged(tmp_path / "four", key)
        assert_close(four, one, terms=forward_terms(tokens=64), magnitude=size, what=key)
    norms = logged(tmp_path / "one", "grad_norm")
    assert_close(logged(tmp_path / "four", "grad_norm"), norms, terms=backward_terms(64))


def test_a_short_run_raises_the_desirable_log_probs(tiny_model_dir, tmp_path):
    """8 answers in one micro-batch of 8: every step sees the same samples, so the logged
    sums compare across steps."""
    data, out = write_jsonl(tmp_path / "answers.jsonl", ROWS[:8]), tmp_path / "run"
    flags = dict(max_steps=6, per_device_train_batch_size=8, learning_rate="1e-2", lora_dropout=0)
    assert main(rlhf(tiny_model_dir, data, out, rlhf_type="kto", **flags)) == 0
    chosen, rejected = logged(out, "logps/chosen"), logged(out, "logps/rejected")
    assert chosen[-1] > chosen[0] and rejected[-1] < rejected[0]
    assert logged(out)[-1] < logged(out)[0]
    assert logged(out, "kl")[0] == 0  # LoRA starts as the identity: policy == reference
    assert logged(out, "count/chosen") == [0.5] * 6
    config = (out / "config.yaml").read_text()
    assert "rlhf_type: kto" in config and "loss_type: kto" in config


def test_preference_pairs_become_one_desirable_and_one_undesirable_answer():
    from swiftlm.data.unpaired import unpaired_samples

    pair = unpaired_samples(PAIRS[1], method="kto")["answers"]
    assert [a["desirable"] for a in pair] == [True, False]
    assert pair[0]["messages"][-1]["content"] == PAIRS[1]["chosen"]
    assert pair[1]["messages"][-1]["content"] == PAIRS[1]["rejected"]
    messages = unpaired_samples(ROWS[0], method="kto", system="Be brief.")["answers"]
    completion = unpaired_samples(
        {"prompt": [{"role": "user", "content": "Question number 0?"}],
         "completion": [{"role": "assistant", "content": "Answer number 0 is 0."}],
         "label": True},
        method="kto", system="Be brief.",
    )["answers"]  # fmt: skip
    assert messages == completion and messages[0]["messages"][0]["role"] == "system"


@pytest.mark.bad_input(
    input="`swiftlm rlhf --rlhf_type kto`: a row whose `label` is not a JSON boolean (1, "
    '"yes"), or a row with neither a label nor a preference pair',
    outcome="`file:line`, the value found and the layouts read; the run does not start",
)
def test_rows_with_a_bad_label_are_refused_with_file_and_line(tiny_model_dir, tmp_path, capsys):
    bad_rows = {
        "number": {**ROWS[0], "label": 1},
        "string": {**ROWS[1], "label": "yes"},
        "unlabelled": {"messages": ROWS[0]["messages"]},
    }
    for name, bad in bad_rows.items():
        data = write_jsonl(tmp_path / f"{name}.jsonl", [ROWS[0], ROWS[1], bad])
        flags = dict(rlhf_type="kto", max_steps=1, per_device_train_batch_size=2)
        argv = rlhf(tiny_model_dir, data, tmp_path / name, **flags)
        assert main(argv) == 1  # a data error, as every bad row of every method
        err = capsys.readouterr().err
        assert f"{name}.jsonl:3:" in err, err
        if name != "unlabelled":
            assert "`label` must be true" in err and "JSON booleans" in err
    assert "`messages` + `label`" in err


@pytest.mark.bad_input(
    input="`swiftlm rlhf --rlhf_type kto --per_device_train_batch_size 1` (KL term), or "
    "--desirable_weight with another method",
    outcome="Error naming the flag and the fix (a batch of 2 or more, or apo_zero_unpaired); "
    "nothing is loaded",
)
@pytest.mark.parametrize(
    "flags, message",
    [
        ({"rlhf_type": "kto", "per_device_train_batch_size": 1}, "--loss_type apo_zero_unpaired"),
        ({"rlhf_type": "dpo", "desirable_weight": 2}, "--desirable_weight is not used by"),
        ({"rlhf_type": "kto", "loss_type": "sigmoid"}, "--rlhf_type kto accepts kto"),
    ],
)
def test_flags_kto_cannot_use_are_refused(
    flags, message, tiny_model_dir, answers, tmp_path, capsys
):
    assert main(rlhf(tiny_model_dir, answers, tmp_path / "run", max_steps=1, **flags)) == 2
    assert message in capsys.readouterr().err


@pytest.mark.numerics
def test_two_gloo_ranks_equal_one_process_under_ddp_and_fsdp2(tiny_model_dir, answers, tmp_path):
    """apo_zero_unpaired's sample normalizer is summed over ranks before the forward (kto's
    KL estimate is per rank and micro-batch, so only this loss type compares exactly)."""
    steps = dict(max_steps=3, learning_rate="5e-3", lora_dropout=0, gradient_accumulation_steps=2)
    steps |= dict(rlhf_type="kto", loss_type="apo_zero_unpaired")
    runs = {
        "single": dict(per_device_train_batch_size=4),
        "ddp": dict(per_device_train_batch_size=2, nproc_per_node=2, master_port=29821),
        "fsdp2": dict(per_device_train_batch_size=2, nproc_per_node=2, master_port=29822, fsdp="fsdp2"),
    }  # fmt: skip
    for name, flags in runs.items():
        assert main(rlhf(tiny_model_dir, answers, tmp_path / name, **steps, **flags)) == 0, name
    size = max(map(abs, logged(tmp_path / "single", "logps/chosen")))  # what loss is made of
    for name in ("ddp", "fsdp2"):
        for key in ("loss", "rewards/chosen"):
            single, parallel = logged(tmp_path / "single", key), logged(tmp_path / name, key)
            terms = forward_terms(tokens=64) + 2  # + the all-reduce of two ranks' sums
            assert_close(parallel, single, terms=terms, magnitude=size, what=f"{name} {key}")


class Crash(Exception):
    pass


@pytest.mark.numerics
def test_a_crashed_run_resumed_equals_an_uninterrupted_one(
    tiny_model_dir, answers, tmp_path, monkeypatch
):
    """KTO keeps no state besides the weights: the KL estimate is rebuilt per micro-batch."""
    from swiftlm.methods.preference.kto import KTO

    flags = dict(max_steps=4, save_steps=2, per_device_train_batch_size=2, lora_dropout=0)
    flags |= dict(rlhf_type="kto", learning_rate="5e-3", gradient_accumulation_steps=2)
    assert main(rlhf(tiny_model_dir, answers, tmp_path / "straight", **flags)) == 0
    real_loss, calls = KTO.loss, {"n": 0}

    def crashing_loss(self, model, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Crash  # as if killed after the step-2 checkpoint
        return real_loss(self, model, batch)

    monkeypatch.setattr(KTO, "loss", crashing_loss)
    with pytest.raises(Crash):
        main(rlhf(tiny_model_dir, answers, tmp_path / "resumed", **flags))
    monkeypatch.setattr(KTO, "loss", real_loss)
    resumed = rlhf(tiny_model_dir, answers, tmp_path / "resumed", **flags)
    assert main([*resumed, "--resume_from_checkpoint", "auto"]) == 0
    # The same arithmetic on the same shapes after the restart: bit for bit.
    assert_same_weights(tmp_path / "straight" / ADAPTER, tmp_path / "resumed" / ADAPTER)
    for key in ("loss", "kl"):
        straight = logged(tmp_path / "straight", key)[-2:]
        assert logged(tmp_path / "resumed", key)[-2:] == straight, key
    assert logged(tmp_path / "straight", "kl")[-1] > 0  # the KL term was exercised


@pytest.mark.numerics
@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_precomputed_reference_log_probs_give_the_same_losses(
    loss_type, tiny_model_dir, answers, tmp_path, capsys, monkeypatch
):
    """--precompute_ref_log_probs: the matched answers' reference log-probs come from the
    samples; the reference runs per step only on kto's mismatched (KL) rows, and never for
    apo_zero_unpaired."""
    from swiftlm.methods.preference.kto import KTO

    common = dict(max_steps=3, learning_rate="5e-3", lora_dropout=0, loss_type=loss_type)
    common |= dict(rlhf_type="kto", per_device_train_batch_size=4)
    assert main(rlhf(tiny_model_dir, answers, tmp_path / "live", **common)) == 0
    real, calls = KTO._reference_logps, []

    def counted(self, model, batch, prefix):
        calls.append(prefix)
        return real(self, model, batch, prefix)

    monkeypatch.setattr(KTO, "_reference_logps", counted)
    precomputed = dict(common, precompute_ref_log_probs="true")
    assert main(rlhf(tiny_model_dir, answers, tmp_path / "precomputed", **precomputed)) == 0
    kept = "kept for the KL rows" if loss_type == "kto" else "freed"
    assert f"reference log-probs of 16 answers precomputed; the reference model is {kept}" in (
        capsys.readouterr().out
    )
    assert calls == (["kl_"] * 3 if loss_type == "kto" else [])  # one KL forward per step
    # Scored apart (another batch) against in the step's forward: the loss and rewards are
    # beta-scaled differences of summed log-probs, so their rounding is those log-probs'.
    size = max(map(abs, logged(tmp_path / "live", "logps/rejected")))
    for key in ("loss", "rewards/chosen", "rewards/rejected", "kl"):
        live, ours = logged(tmp_path / "live", key), logged(tmp_path / "precomputed", key)
        assert_close(ours, live, terms=forward_terms(tokens=64), magnitude=size, what=key)
    assert logged(tmp_path / "live", "rewards/chosen")[-1] != 0  # the policy moved
