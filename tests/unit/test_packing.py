"""Packed rows give every sample exactly the loss it has alone: no attention across samples,
positions restarting per sample, and no label that crosses a sample boundary."""

import pytest
import torch
import torch.nn.functional as F

from swiftlm.data.collate import collate, collate_packed, count_input_tokens, model_inputs
from swiftlm.data.encode import IGNORE_INDEX
from swiftlm.losses.causal_lm import shifted_labels
from swiftlm.models.attention import VARLEN, register_varlen_attention, segment_bounds
from tolerance import assert_close, forward_terms, rounding_bound

LENGTHS = [17, 40, 9, 33, 25]


def _samples(lengths: list[int], vocab: int, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        ids = torch.randint(5, vocab, (n,), generator=generator).tolist()
        # The first third is "prompt" (no loss), the rest "answer".
        labels = [IGNORE_INDEX] * (n // 3) + ids[n // 3 :]
        samples.append({"input_ids": ids, "labels": labels})
    return samples


@torch.no_grad()
def _token_losses(model, batch: dict) -> torch.Tensor:
    logits = model(**model_inputs(batch)).logits.float()
    targets = shifted_labels(batch["labels"])
    losses = F.cross_entropy(
        logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none"
    )
    return losses


def _alone(model, samples: list[dict]) -> list[float]:
    return [float(_token_losses(model, collate([s], 0)).sum()) for s in samples]


def _packed(model, rows: list[list[dict]]) -> list[float]:
    batch = collate_packed(rows, 0)
    losses = _token_losses(model, batch)
    per_sample = []
    for r, row in enumerate(rows):
        start = 0
        for sample in row:
            end = start + len(sample["input_ids"])
            per_sample.append(float(losses[r, start:end].sum()))
            start = end
    return per_sample


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    register_varlen_attention()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    # As in training: with a KV cache transformers ignores the packed position ids.
    model.config.use_cache = False
    return model


@pytest.mark.numerics
@pytest.mark.parametrize("attention", ["sdpa", "eager", VARLEN])
def test_packed_per_sample_losses_equal_unpacked(model, attention):
    model.set_attn_implementation(attention)
    try:
        samples = _samples(LENGTHS, model.config.vocab_size)
        expected = _alone(model, samples)
        # One flat row (padding-free) and two rows of different widths (packing + padding).
        flat = _packed(model, [samples])
        two_rows = _packed(model, [samples[:2], samples[2:]])
    finally:
        model.set_attn_implementation("sdpa")
    # fp32 on CPU: the same sums in another order (a block of a bigger matmul), in a row of up
    # to all the samples' tokens.
    terms = forward_terms(sum(LENGTHS))
    for got in (flat, two_rows):
        assert_close(got, expected, terms=terms, what=f"{attention} per-sample loss sums")


def test_without_restarting_positions_samples_would_leak(model):
    """The check above can fail: a row without the restarts attends across samples."""
    samples = _samples([17, 40], model.config.vocab_size)
    expected = _alone(model, samples)
    batch = collate_packed([samples], 0)
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
    losses = _token_losses(model, batch)
    second = float(losses[0, 17:].sum())
    # Far above the rounding bound the check above allows (1.3 against 5e-3 here).
    bound = rounding_bound(expected[1], forward_terms(sum(LENGTHS)))
    assert abs(second - expected[1]) > 10 * bound


def test_packed_layout():
    samples = _samples([3, 4], 100)
    batch = collate_packed([samples, samples[:1]], pad_token_id=0)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 0, 1, 2, 3]]
    assert batch["token_mask"].tolist() == [[1] * 7, [1, 1, 1, 0, 0, 0, 0]]
    # Each sample's first label is masked, so no token learns to predict the next sample.
    assert batch["labels"][0, 3] == IGNORE_INDEX
    assert count_input_tokens(batch) == 10
    assert set(model_inputs(batch)) == {"input_ids", "position_ids"}
    assert segment_bounds(batch["position_ids"]) == [[(0, 3), (3, 7)], [(0, 3), (3, 7)]]


def test_segment_bounds_of_unpacked_rows():
    positions = torch.arange(6).repeat(2, 1)
    assert segment_bounds(positions) == [[(0, 6)], [(0, 6)]]


def test_training_attention_choice():
    from types import SimpleNamespace

    from swiftlm.models.attention import training_attention

    cpu = torch.device("cpu")
    assert training_attention("sdpa", cpu, packed=False) == "sdpa"
    assert training_attention("sdpa", cpu, packed=True) == VARLEN
    assert training_attention("eager", cpu, packed=True) == "eager"
    windowed = SimpleNamespace(sliding_window=256, use_sliding_window=True)
    assert training_attention("sdpa", cpu, True, windowed, max_length=512) == "sdpa"
    assert training_attention("sdpa", cpu, True, windowed, max_length=256) == VARLEN
    off = SimpleNamespace(sliding_window=256, use_sliding_window=False)
    assert training_attention("sdpa", cpu, True, off, max_length=512) == VARLEN
