"""`swiftlm rlhf --rlhf_type dpo` options: several loss types with weights and bco_pair's
running reward shift (against the formula over separate forwards), --ref_model (another
frozen model as the reference; a different vocabulary refused) and
--precompute_ref_log_probs (the same losses, with the reference scored once and freed)."""

import math

import pytest
import torch
from test_dpo import ROWS, rlhf

from conftest import build_tiny_llama, build_tokenizer, logged, make_tiny_llama, write_jsonl
from swiftlm.cli.main import main
from swiftlm.data.encode import IGNORE_INDEX
from tolerance import assert_close, forward_terms

# Every row here is shorter than 64 tokens (the max_length of method_batches_model).
TERMS = forward_terms(tokens=64)


@pytest.fixture
def pairs(tmp_path):
    return write_jsonl(tmp_path / "pairs.jsonl", ROWS)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """Another tiny Llama (seed 1) with the same tokenizer: a --ref_model."""
    out = tmp_path_factory.mktemp("ref-llama")
    build_tiny_llama(out, vocab_size=len(build_tokenizer(out)), seed=1)
    return out


def method_batches_model(model_dir, flags: dict, groups=((0, 1, 2), (3, 4))):
    """(method, collated batches of ROWS' pairs grouped by `groups`, their samples, a LoRA
    model with random adapter weights in training mode)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftlm.config import RLHFConfig
    from swiftlm.config.parse import from_flat_dict
    from swiftlm.methods.base import Layout
    from swiftlm.methods.registry import METHODS

    cfg = from_flat_dict(RLHFConfig, {**flags, "max_length": 64})
    method = METHODS["dpo"](cfg, AutoTokenizer.from_pretrained(model_dir))
    samples = method.encode([method.to_sample(row) for row in ROWS[:5]]).samples
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, lora).train()
    grouped = [[samples[i] for i in group] for group in groups]
    batches = [method.collate(Layout([[s] for s in g], False)) for g in grouped]
    return method, batches, grouped, model


def answer_logp(model, sample, side: str, adapter: bool = True) -> float:
    ids, labels = sample[f"{side}_input_ids"], sample[f"{side}_labels"]
    with torch.no_grad():
        if adapter:
            logits = model(torch.tensor([ids])).logits[0].double()
        else:
            with model.disable_adapter():
                logits = model(torch.tensor([ids])).logits[0].double()
    logps = torch.log_softmax(logits, -1)
    return sum(logps[t - 1, ids[t]].item() for t in range(1, len(ids)) if labels[t] != IGNORE_INDEX)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


@pytest.mark.numerics
def test_weighted_sigmoid_and_bco_pair_equal_the_formula_with_the_running_shift(tiny_model_dir):
    """delta of micro-batch k = the mean of micro-batches 1..k's mean rewards (TRL's running
    mean, updated before the loss); evaluation reads it without updating it."""
    flags = {"beta": 0.3, "loss_type": ["sigmoid", "bco_pair"], "loss_weights": [0.8, 0.2]}
    method, batches, groups, model = method_batches_model(tiny_model_dir, flags)
    batch_means, expected_losses, sizes = [], [], []
    for group in groups:
        ratios, logps = [], 0.0
        for s in group:
            c, r = answer_logp(model, s, "chosen"), answer_logp(model, s, "rejected")
            c0 = answer_logp(model, s, "chosen", adapter=False)
            r0 = answer_logp(model, s, "rejected", adapter=False)
            ratios.append((c - c0, r - r0))
            logps += abs(c) + abs(r) + abs(c0) + abs(r0)
        # Each loss term is a log-sigmoid (slope <= 1) of beta-scaled differences of summed
        # log-probs, and so is the shift (a mean of the batches' mean rewards): the loss's
        # rounding is the log-probs', beta times theirs, twice (the shift), plus its own.
        sizes.append(2 * 0.3 * logps)
        rewards = [0.3 * u for pair in ratios for u in pair]
        batch_means.append(sum(rewards) / len(rewards))
        delta = sum(batch_means) / len(batch_means)
        expected_losses.append(
            sum(
                0.8 * -log_sigmoid(0.3 * (uc - ur))
                + 0.2 * (-log_sigmoid(0.3 * uc - delta) - log_sigmoid(-(0.3 * ur - delta)))
                for uc, ur in ratios
            )
        )
    for batch, expected, size in zip(batches, expected_losses, sizes, strict=True):
        loss, _ = method.loss(model, batch)
        assert_close(loss, expected, terms=TERMS, magnitude=size + expected, what="loss")
    assert method.bco_mean.count == 2 and batch_means[0] != pytest.approx(batch_means[1])
    model.eval()
    method.loss(model, batches[0])
    assert method.bco_mean.count == 2  # evaluation does not move the shift


@pytest.mark.numerics
def test_several_loss_types_train_round_trip_and_must_match_on_resume(
    tiny_model_dir, pairs, tmp_path, capsys
):
    from swiftlm.config import RLHFConfig
    from swiftlm.config.parse import load_saved_config

    out = tmp_path / "run"
    flags = dict(max_steps=2, save_steps=2, per_device_train_batch_size=4, lora_dropout=0)
    argv = rlhf(tiny_model_dir, pairs, out, **flags)
    combined = ["--loss_type", "sigmoid", "bco_pair", "--loss_weights", "0.8", "0.2"]
    assert main(argv + combined) == 0
    # LoRA starts as the identity (B = 0: the adapter adds exact zeros): u_c = u_r = 0 and
    # delta 0 exactly, so only the float32 log-sigmoids of 0 and their weighted sums round.
    assert_close(logged(out)[0], 1.2 * math.log(2), terms=4, what="step-1 loss")
    config = (out / "config.yaml").read_text()
    assert "loss_type:\n  - sigmoid\n  - bco_pair" in config and "  - 0.8\n  - 0.2" in config
    saved = load_saved_config(RLHFConfig, out / "config.yaml").rlhf  # the YAML round trip
    assert (saved.loss_type, saved.loss_weights) == (["sigmoid", "bco_pair"], [0.8, 0.2])
    again = rlhf(tiny_model_dir, pairs, out, **{**flags, "max_steps": 4})
    other = ["--loss_type", "sigmoid", "bco_pair", "--loss_weights", "0.5", "0.5"]
    assert main([*again, *other, "--resume_from_checkpoint", "auto"]) == 2
    assert "--loss_weights: saved 0.8 0.2, now 0.5 0.5" in capsys.readouterr().err


@pytest.mark.bad_input(
    input="`swiftlm rlhf`: several --loss_type for a method other than dpo, or --loss_weights "
    "whose count differs from --loss_type's",
    outcome="Error naming the flags and what they need; nothing is loaded",
)
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rlhf_type", "cpo", "--loss_type", "sigmoid", "hinge"], "only --rlhf_type dpo"),
        (["--loss_type", "sigmoid", "--loss_weights", "1", "2"], "one weight per --loss_type"),
        (["--rlhf_type", "simpo", "--precompute_ref_log_probs", "true"], "is not used by"),
    ],
)
def test_bad_loss_type_lists_are_refused(extra, message, tiny_model_dir, pairs, tmp_path, capsys):
    argv = rlhf(tiny_model_dir, pairs, tmp_path / "run", max_steps=1)
    assert main(argv + extra) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.numerics
@pytest.mark.parametrize("train_type", ["lora", "full"])
def test_ref_model_is_the_frozen_reference(train_type, tiny_model_dir, other_model_dir):
    """The loss of a batch with another model as the reference equals the formula with that
    model's log-probs; the reference is frozen and apart from the policy."""
    from transformers import AutoModelForCausalLM

    flags = {"beta": 0.3, "ref_model": str(other_model_dir), "train_type": train_type}
    method, batches, groups, model = method_batches_model(tiny_model_dir, flags)
    method.prepare_model(model, print)
    assert all(not p.requires_grad for p in method.reference.parameters())
    other = AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32)
    expected, size = 0.0, 0.0
    for s in groups[0]:
        c, r = answer_logp(model, s, "chosen"), answer_logp(model, s, "rejected")
        c0 = answer_logp(_Plain(other), s, "chosen")
        r0 = answer_logp(_Plain(other), s, "rejected")
        expected += -log_sigmoid(0.3 * ((c - c0) - (r - r0)))
        size += 0.3 * (abs(c) + abs(r) + abs(c0) + abs(r0))  # log-sigmoid: slope <= 1
    loss, _ = method.loss(model, batches[0])
    assert_close(loss, expected, terms=TERMS, magnitude=size + expected, what="loss")


class _Plain:
    """A model called like answer_logp's policy (no adapter to disable)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, ids):
        return self.model(ids)


def test_a_ref_model_run_starts_away_from_ln2(tiny_model_dir, other_model_dir, pairs, tmp_path):
    out = tmp_path / "run"
    flags = dict(max_steps=2, per_device_train_batch_size=4, ref_model=other_model_dir)
    assert main(rlhf(tiny_model_dir, pairs, out, **flags)) == 0
    assert logged(out)[0] != pytest.approx(math.log(2), abs=1e-3)
    assert f"ref_model: {other_model_dir}" in (out / "config.yaml").read_text()


@pytest.mark.bad_input(
    input="`swiftlm rlhf --ref_model` whose vocabulary size differs from the policy's",
    outcome="Error naming both sizes and that the reference needs the policy's tokenizer",
)
def test_a_ref_model_with_another_vocabulary_is_refused(tiny_model_dir, pairs, tmp_path, capsys):
    other = tmp_path / "other-vocab"
    tokenizer = build_tokenizer(other)
    make_tiny_llama(len(tokenizer) + 16).save_pretrained(other)
    flags = dict(max_steps=1, per_device_train_batch_size=4, ref_model=other)
    assert main(rlhf(tiny_model_dir, pairs, tmp_path / "run", **flags)) == 2
    err = capsys.readouterr().err
    assert f"--ref_model {other}: its vocabulary has {len(tokenizer) + 16} tokens" in err
    assert "same tokenizer" in err


@pytest.mark.numerics
@pytest.mark.parametrize("train_type", ["lora", "full"])
def test_precomputed_reference_log_probs_give_the_same_losses(
    train_type, tiny_model_dir, pairs, tmp_path, capsys
):
    common = dict(max_steps=3, per_device_train_batch_size=4, train_type=train_type)
    common |= dict(learning_rate="5e-3" if train_type == "lora" else "1e-4", lora_dropout=0)
    common |= dict(split_dataset_ratio=0.25, eval_steps=3)
    runs = {"live": {}, "precomputed": {"precompute_ref_log_probs": "true"}}
    for name, flags in runs.items():
        assert main(rlhf(tiny_model_dir, pairs, tmp_path / name, **common, **flags)) == 0
    assert "the reference model is freed" in capsys.readouterr().out
    # The reference's log-probs scored apart (another batch) against in the step's forward:
    # the loss and margins are beta-scaled (0.1) differences of the policy's and reference's
    # summed log-probs (log-sigmoid: slope <= 1), so their rounding is those log-probs'.
    chosen = logged(tmp_path / "live", "logps/chosen")
    rejected = logged(tmp_path / "live", "logps/rejected")
    size = 2 * 0.1 * max(abs(c) + abs(r) for c, r in zip(chosen, rejected, strict=True))
    for key in ("loss", "rewards/margins", "eval_loss"):
        live, precomputed = logged(tmp_path / "live", key), logged(tmp_path / "precomputed", key)
        assert_close(precomputed, live, terms=TERMS, magnitude=size + max(live), what=key)
    assert logged(tmp_path / "live", "rewards/margins")[-1] != 0  # the policy moved


@pytest.mark.numerics
def test_precomputing_frees_the_full_fine_tuning_reference(tiny_model_dir):
    flags = {"train_type": "full", "precompute_ref_log_probs": True, "torch_dtype": "float32"}
    method, batches, groups, model = method_batches_model(tiny_model_dir, flags)
    method.prepare_model(model, print)
    train, val = method.prepare_samples(model, groups[0], groups[1], print)
    assert method.reference is None  # never copied, nothing held
    # A padded batch against one unpadded forward, float64: a sum of log-probs of one sign.
    want = answer_logp(model, groups[0][0], "chosen")
    assert_close(train[0]["ref_chosen_logps"], want, terms=TERMS, what="reference log-prob")
    assert len(val) == 2 and "ref_rejected_logps" in val[1]


@pytest.mark.numerics
def test_a_precomputed_ref_model_is_loaded_scored_and_freed(tiny_model_dir, other_model_dir):
    from transformers import AutoModelForCausalLM

    flags = {"ref_model": str(other_model_dir), "precompute_ref_log_probs": True}
    method, batches, groups, model = method_batches_model(
        tiny_model_dir, {**flags, "torch_dtype": "float32"}
    )
    method.prepare_model(model, print)
    assert method.reference is not None
    train, _ = method.prepare_samples(model, groups[0], [], print)
    assert method.reference is None
    other = AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32)
    expected = answer_logp(_Plain(other), groups[0][1], "rejected")
    assert_close(train[1]["ref_rejected_logps"], expected, terms=TERMS, what="reference log-prob")
