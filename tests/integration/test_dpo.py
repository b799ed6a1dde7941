"""`swiftlm rlhf --rlhf_type dpo` on a tiny model: ln 2 at the first step, the loss of a batch
against an independent computation, gradient accumulation, LoRA's reference without a copy,
full fine-tuning's frozen reference, and the preference row layouts."""

import math

import pytest
import torch

from conftest import logged, write_jsonl
from swiftlm.cli.main import main
from swiftlm.data.collate import count_input_tokens
from tolerance import (
    assert_close,
    assert_same_weights,
    assert_trained_weights_close,
    backward_terms,
    forward_terms,
)

ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Question number {i}?"},
            {"role": "assistant", "content": f"Answer number {i} is {i * 7}."},
        ],
        "rejected_response": f"I do not know {i}.",
    }
    if i % 2 == 0
    else {
        "prompt": f"Question number {i}?",
        "chosen": f"Answer number {i} is {i * 7}.",
        "rejected": f"No idea about {i}.",
    }
    for i in range(16)
]
ADAPTER = "final/adapter_model.safetensors"


def rlhf(model_dir, data, out, **flags) -> list[str]:
    defaults = {"torch_dtype": "float32", "report_to": "none", "logging_steps": 1}
    argv = ["rlhf", "--model", str(model_dir), "--dataset", str(data), "--output_dir", str(out)]
    for name, value in {**defaults, **flags}.items():
        argv += [f"--{name}", str(value)]
    return argv


@pytest.fixture
def pairs(tmp_path):
    return write_jsonl(tmp_path / "pairs.jsonl", ROWS)


def test_first_step_is_ln2_and_the_margin_grows(tiny_model_dir, pairs, tmp_path):
    out = tmp_path / "run"
    flags = dict(max_steps=4, per_device_train_batch_size=4, learning_rate="5e-3", lora_dropout=0)
    assert main(rlhf(tiny_model_dir, pairs, out, **flags)) == 0
    losses = logged(out)
    # LoRA starts as the identity (B = 0, so policy == reference bit for bit): the loss is
    # the mean of 4 times -log sigmoid(0), rounded once each.
    assert_close(losses[0], math.log(2), terms=4, what="first loss")
    assert logged(out, "rewards/margins")[0] == 0
    assert logged(out, "rewards/margins")[-1] > 0 and losses[-1] < losses[0]
    assert logged(out, "rewards/accuracies")[-1] > 0.5
    assert "rlhf_type: dpo" in (out / "config.yaml").read_text()


@pytest.mark.numerics
def test_accumulating_4_micro_batches_of_1_equals_1_batch_of_4(tiny_model_dir, pairs, tmp_path):
    common = dict(max_steps=3, learning_rate="5e-3", lora_dropout=0)
    runs = {
        "one": dict(per_device_train_batch_size=4, gradient_accumulation_steps=1),
        "four": dict(per_device_train_batch_size=1, gradient_accumulation_steps=4),
    }
    for name, flags in runs.items():
        assert main(rlhf(tiny_model_dir, pairs, tmp_path / name, **common, **flags)) == 0
    # The loss is a sigmoid of beta-scaled differences of summed log-probs: its rounding is
    # theirs (pairs under 64 tokens).
    size = max(map(abs, logged(tmp_path / "one", "logps/chosen")))
    terms = forward_terms(tokens=64)
    loss_four, loss_one = logged(tmp_path / "four"), logged(tmp_path / "one")
    assert_close(loss_four, loss_one, terms=terms, magnitude=size, what="loss")
    norms = logged(tmp_path / "one", "grad_norm")
    assert_close(logged(tmp_path / "four", "grad_norm"), norms, terms=backward_terms(64))
    one, four = tmp_path / "one" / ADAPTER, tmp_path / "four" / ADAPTER
    assert_trained_weights_close(one, four, learning_rate=5e-3, steps=3)


def loss_on_three_pairs(model_dir, flags: dict):
    """(method, encoded samples, a LoRA model with random adapter weights, loss, metrics) of
    one micro-batch of ROWS' first three pairs under `swiftlm rlhf` `flags`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftlm.config import RLHFConfig
    from swiftlm.config.parse import from_flat_dict
    from swiftlm.methods.base import Layout
    from swiftlm.methods.registry import METHODS

    cfg = from_flat_dict(RLHFConfig, {**flags, "max_length": 64})
    method = METHODS[cfg.rlhf.rlhf_type](cfg, AutoTokenizer.from_pretrained(model_dir))
    samples = method.encode([method.to_sample(row) for row in ROWS[:3]]).samples
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, lora)
    batch = method.collate(Layout([[s] for s in samples], False))
    return method, samples, model, *method.loss(model, batch)


@pytest.mark.numerics
def test_the_loss_of_a_batch_equals_an_independent_computation(tiny_model_dir, tmp_path):
    """Per-answer log-probs from separate forwards of each conversation (transformers, no
    padding), the reference with peft's adapter disabled, and DPO's formula by hand."""
    from swiftlm.data.encode import IGNORE_INDEX
    from swiftlm.methods.base import Layout

    flags = {"beta": 0.3, "rpo_alpha": 0.5}
    method, samples, model, loss, metrics = loss_on_three_pairs(tiny_model_dir, flags)

    def answer_logp(ids, labels, adapter: bool) -> tuple[float, int]:
        with torch.no_grad(), model.disable_adapter() if not adapter else _nothing():
            logits = model(torch.tensor([ids])).logits[0].double()
        logps = torch.log_softmax(logits, -1)
        picked = [
            logps[t - 1, ids[t]].item() for t in range(1, len(ids)) if labels[t] != IGNORE_INDEX
        ]
        return sum(picked), len(picked)

    expected, margins, size = 0.0, 0.0, 0.0
    for s in samples:
        (c, n), (r, _) = (
            answer_logp(s[f"{k}_input_ids"], s[f"{k}_labels"], True) for k in ("chosen", "rejected")
        )
        c0, _ = answer_logp(s["chosen_input_ids"], s["chosen_labels"], False)
        r0, _ = answer_logp(s["rejected_input_ids"], s["rejected_labels"], False)
        z = 0.3 * ((c - c0) - (r - r0))
        expected += -math.log(1 / (1 + math.exp(-z))) + 0.5 * (-c / n)
        margins += 0.3 * (c - c0) - 0.3 * (r - r0)
        size += abs(c) + abs(c0) + abs(r) + abs(r0)
    # Batched, padded forwards against one unpadded forward per answer: the loss and margins
    # carry the rounding of the summed log-probs they are made of.
    terms = forward_terms(tokens=64)  # every conversation here is under 64 tokens
    assert_close(loss, expected, terms=terms, magnitude=size, what="loss")
    assert_close(metrics["rewards/margins"], margins, terms=terms, magnitude=size)
    assert method.normalizer(method.collate(Layout([[s] for s in samples], False))) == 3


def layout_runs(method, model, samples) -> dict:
    """Per layout of `samples` (padded rows; one packed row; two packed rows), the loss,
    metrics and LoRA gradients of one micro-batch, and the batch; attention per segment."""
    from swiftlm.methods.base import Layout
    from swiftlm.models.attention import VARLEN, register_varlen_attention

    register_varlen_attention()
    model.base_model.model.config._attn_implementation = VARLEN
    layouts = {
        "padded": Layout([[s] for s in samples], False),
        "padding_free": Layout([samples], True),
        "packed": Layout([samples[:2], samples[2:]], True),
    }
    runs = {}
    for name, layout in layouts.items():
        model.zero_grad()
        batch = method.collate(layout)
        loss, metrics = method.loss(model, batch)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        runs[name] = (loss.item(), metrics, grads, batch)
    return runs


def assert_packed_runs_equal_padded(runs: dict, metric_keys, size: float) -> None:
    """The packed layouts' loss, metrics and gradients within the rounding of the padded
    one's (`size`: the magnitude of what the loss and metrics sum)."""
    loss, metrics, grads, batch = runs["padded"]
    terms = forward_terms(tokens=64)
    for name in ("padding_free", "packed"):
        other_loss, other_metrics, other_grads, other_batch = runs[name]
        assert count_input_tokens(other_batch) == count_input_tokens(batch)  # no padding
        assert "attention_mask" not in other_batch
        assert_close(other_loss, loss, terms=terms, magnitude=size, what=f"{name} loss")
        for key in metric_keys:
            assert_close(other_metrics[key], metrics[key], terms=terms, magnitude=size, what=key)
        for ours, theirs in zip(other_grads, grads, strict=True):
            scale = theirs.abs().max().item()
            assert_close(ours, theirs, terms=backward_terms(64), magnitude=scale, what="grad")
    assert runs["padding_free"][3]["input_ids"].shape[0] == 1


@pytest.mark.numerics
@pytest.mark.parametrize("flags", [{"beta": 0.3, "rpo_alpha": 0.5}, {"rlhf_type": "simpo"}])
def test_padding_free_pairs_equal_padded_pairs(tiny_model_dir, flags):
    """Every answer of a micro-batch in one packed row (positions restarting per answer,
    swiftlm's per-segment attention), two rows of --packing, and one padded row per answer
    give the same per-answer log-probs, loss, metrics and LoRA gradients: the same sums, in
    other orders."""
    from swiftlm.methods.preference.dpo import answer_logps

    method, samples, model, *_ = loss_on_three_pairs(tiny_model_dir, flags)
    runs = layout_runs(method, model, samples)
    with torch.no_grad():
        answers = {name: answer_logps(model, run[3])[0].tolist() for name, run in runs.items()}
    for name in ("padding_free", "packed"):
        for ours, theirs in zip(answers[name], answers["padded"], strict=True):
            terms = forward_terms(tokens=64)
            assert_close(ours, theirs, terms=terms, magnitude=abs(theirs), what="answer log-prob")
    size = sum(map(abs, answers["padded"]))  # what the loss and the metrics are sums of
    assert_packed_runs_equal_padded(
        runs, ("logps/chosen", "logps/rejected", "rewards/margins"), size
    )


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_lora_keeps_no_reference_copy_and_full_fine_tuning_a_frozen_one(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftlm.config import RLHFConfig
    from swiftlm.config.parse import from_flat_dict
    from swiftlm.methods.preference.dpo import DPO

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    lora = DPO(from_flat_dict(RLHFConfig, {}), tokenizer)
    lora.prepare_model(model, print)
    assert lora.reference is None
    full = DPO(from_flat_dict(RLHFConfig, {"train_type": "full"}), tokenizer)
    full.prepare_model(model, print)
    reference = dict(full.reference.named_parameters())
    assert all(not p.requires_grad for p in reference.values())
    name, weight = next(iter(model.named_parameters()))
    assert reference[name].data_ptr() != weight.data_ptr()  # a copy, not the trained weights


def test_full_fine_tuning_starts_at_ln2(tiny_model_dir, pairs, tmp_path):
    out = tmp_path / "full"
    flags = dict(
        max_steps=2, per_device_train_batch_size=4, train_type="full", learning_rate="1e-4"
    )
    assert main(rlhf(tiny_model_dir, pairs, out, **flags)) == 0
    # Policy and frozen reference are the same weights at step 1, bit for bit (see above).
    assert_close(logged(out)[0], math.log(2), terms=4, what="first loss")
    assert logged(out, "rewards/margins")[1] != 0  # the policy moved away from its reference


@pytest.mark.bad_input(
    input="`swiftlm rlhf`: a row that is not a preference pair, or whose chosen and rejected "
    "answers are identical",
    outcome="`file:line` and the layouts read (ms-swift messages + rejected_response, TRL "
    "prompt/chosen/rejected); the run does not start",
)
def test_rows_that_are_not_pairs_are_refused_with_file_and_line(tiny_model_dir, tmp_path, capsys):
    sft_row = {"messages": ROWS[0]["messages"]}
    same = {"prompt": "Hi?", "chosen": "Hello.", "rejected": "Hello."}
    for name, bad in (("plain", sft_row), ("same", same)):
        data = write_jsonl(tmp_path / f"{name}.jsonl", [ROWS[1], bad])
        assert main(rlhf(tiny_model_dir, data, tmp_path / name, max_steps=1)) == 1
        err = capsys.readouterr().err
        assert f"{name}.jsonl:2:" in err
    assert "identical" in err


def test_ms_swift_and_trl_layouts_give_the_same_pair():
    from swiftlm.data.preference import preference_sample

    question = [{"role": "user", "content": "Hi?"}]
    forms = [
        {"messages": [*question, {"role": "assistant", "content": "Hello."}], "rejected_response": "Go."},
        {
            "messages": [*question, {"role": "assistant", "content": "Hello."}],
            "rejected_messages": [*question, {"role": "assistant", "content": "Go."}],
        },
        {"prompt": "Hi?", "chosen": "Hello.", "rejected": "Go."},
        {"prompt": question, "chosen": [{"role": "assistant", "content": "Hello."}],
         "rejected": [{"role": "assistant", "content": "Go."}]},
        {"chosen": [*question, {"role": "assistant", "content": "Hello."}],
         "rejected": [*question, {"role": "assistant", "content": "Go."}]},
    ]  # fmt: skip
    pairs = [preference_sample(form, method="rlhf", system="Be brief.") for form in forms]
    assert all(pair == pairs[0] for pair in pairs)
    assert pairs[0]["chosen"][0] == {"role": "system", "content": "Be brief."}
    assert pairs[0]["rejected"][-1]["content"] == "Go."


@pytest.mark.numerics
def test_two_gloo_ranks_equal_one_process_under_ddp_and_fsdp2(tiny_model_dir, pairs, tmp_path):
    """DPO's pair normalizer is summed over ranks before the forward, as SFT's tokens are; the
    LoRA reference runs inside the wrapped model with the adapter disabled."""
    steps = dict(max_steps=3, learning_rate="5e-3", lora_dropout=0, gradient_accumulation_steps=2)
    runs = {
        "single": dict(per_device_train_batch_size=4),
        "ddp": dict(per_device_train_batch_size=2, nproc_per_node=2, master_port=29761),
        "fsdp2": dict(per_device_train_batch_size=2, nproc_per_node=2, master_port=29762, fsdp="fsdp2"),
    }  # fmt: skip
    for name, flags in runs.items():
        assert main(rlhf(tiny_model_dir, pairs, tmp_path / name, **steps, **flags)) == 0, name
    single = logged(tmp_path / "single")
    size = max(map(abs, logged(tmp_path / "single", "logps/chosen")))  # what the loss is made of
    terms = forward_terms(tokens=64) + 2  # + the all-reduce of two ranks' sums
    for name in ("ddp", "fsdp2"):
        assert_close(logged(tmp_path / name), single, terms=terms, magnitude=size, what=name)
        margins = logged(tmp_path / name, "rewards/margins")
        expected = logged(tmp_path / "single", "rewards/margins")
        assert_close(margins, expected, terms=terms, magnitude=size, what=f"{name} margins")
        a, b = tmp_path / "single" / ADAPTER, tmp_path / name / ADAPTER
        assert_trained_weights_close(a, b, learning_rate=5e-3, steps=3)


class Crash(Exception):
    pass


@pytest.mark.parametrize("train_type", ["lora", "full"])
def test_a_crashed_run_resumed_equals_an_uninterrupted_one(
    train_type, tiny_model_dir, pairs, tmp_path, monkeypatch, capsys
):
    """Full fine-tuning's frozen reference is the initial model also after a resume (it is
    taken before the checkpoint's weights load)."""
    from swiftlm.methods.preference.dpo import DPO

    flags = dict(max_steps=4, save_steps=2, per_device_train_batch_size=4, train_type=train_type)
    flags |= dict(learning_rate="5e-3" if train_type == "lora" else "1e-4", lora_dropout=0)
    assert main(rlhf(tiny_model_dir, pairs, tmp_path / "straight", **flags)) == 0
    real_loss, calls = DPO.loss, {"n": 0}

    def crashing_loss(self, model, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Crash  # as if killed after the step-2 checkpoint
        return real_loss(self, model, batch)

    monkeypatch.setattr(DPO, "loss", crashing_loss)
    with pytest.raises(Crash):
        main(rlhf(tiny_model_dir, pairs, tmp_path / "resumed", **flags))
    monkeypatch.setattr(DPO, "loss", real_loss)
    resumed = rlhf(tiny_model_dir, pairs, tmp_path / "resumed", **flags)
    assert main([*resumed, "--resume_from_checkpoint", "auto"]) == 0
    assert "resumed from" in capsys.readouterr().out
    weights = "adapter_model.safetensors" if train_type == "lora" else "model.safetensors"
    # The same arithmetic on the same shapes after the restart: bit for bit.
    assert_same_weights(
        tmp_path / "straight" / "final" / weights, tmp_path / "resumed" / "final" / weights
    )
    for key in ("loss", "rewards/margins"):
        straight = logged(tmp_path / "straight", key)[-2:]
        assert logged(tmp_path / "resumed", key)[-2:] == straight, key


@pytest.mark.bad_input(
    input="`swiftlm rlhf --resume_from_checkpoint` with another --beta, --loss_type or "
    "--rlhf_type than the run was saved with",
    outcome="Error naming each `--flag: saved X, now Y`; nothing is trained",
)
def test_resuming_with_another_beta_is_refused(tiny_model_dir, pairs, tmp_path, capsys):
    flags = dict(max_steps=2, save_steps=2, per_device_train_batch_size=4)
    assert main(rlhf(tiny_model_dir, pairs, tmp_path / "run", **flags)) == 0
    again = rlhf(tiny_model_dir, pairs, tmp_path / "run", **{**flags, "max_steps": 4}, beta=0.5)
    assert main([*again, "--resume_from_checkpoint", "auto"]) == 2
    assert "--beta: saved 0.1, now 0.5" in capsys.readouterr().err
