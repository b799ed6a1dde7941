"""Token losses: checked against a hand-written float64 reference; accumulation is exact;
per-token losses and their per-sequence sums for padded and packed batches."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from swiftlm.data.collate import collate, collate_packed
from swiftlm.data.encode import IGNORE_INDEX
from swiftlm.losses.causal_lm import (
    causal_lm_loss,
    count_label_tokens,
    count_sequences,
    sequence_ids_from_batch,
    sequence_sums,
    shifted_labels,
    token_cross_entropy,
    token_cross_entropy_sum,
)
from tolerance import assert_close

I = IGNORE_INDEX  # noqa: E741

LABELS = torch.tensor(
    [
        [I, I, 3, 5, I, 6],  # prompt masked, answer 3 5 / 6
        [1, 2, 0, 4, 4, 2],  # every token; the first label has nothing predicting it
        [I, I, I, I, 2, I],  # a single loss token
    ]
)
V = 7  # the vocabulary of random_logits
# A summed cross-entropy carries the log-softmax's sum over V and the sum over the label tokens
# (9 of LABELS). A token's loss is (max - logit) + log(sum of exp(logit - max)), a sum >= 1 of
# terms <= 1: its rounding is relative to 1 + the loss, so a sum's magnitude is sum + tokens.
SUM_TERMS = V + count_label_tokens(LABELS)


def ce_size(loss_sum, tokens: int) -> float:
    """The magnitude behind a sum of `tokens` token cross-entropies (see SUM_TERMS)."""
    return float(loss_sum) + tokens


def reference_sum(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """sum over t of -log softmax(logits[b, t])[labels[b, t + 1]], labels != IGNORE, float64."""
    total = 0.0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            target = int(labels[b, t + 1])
            if target == IGNORE_INDEX:
                continue
            row = logits[b, t].double()
            total -= float(row[target] - torch.logsumexp(row, dim=0))
    return total


def random_logits(shape=(3, 6, 7), seed=0, scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator) * scale


def test_shifted_labels():
    assert shifted_labels(LABELS).tolist() == [
        [I, 3, 5, I, 6, I],
        [2, 0, 4, 4, 2, I],
        [I, I, I, 2, I, I],
    ]


def test_count_label_tokens():
    assert count_label_tokens(LABELS) == 3 + 5 + 1
    assert count_label_tokens(LABELS[:1]) == 3
    assert count_label_tokens(torch.tensor([[7]])) == 0
    assert count_label_tokens(torch.full((2, 4), I)) == 0
    assert isinstance(count_label_tokens(LABELS), int)


@pytest.mark.numerics
def test_cross_entropy_sum_matches_hand_written_reference():
    logits = random_logits()
    got = token_cross_entropy_sum(logits, LABELS)
    assert got.dtype == torch.float32 and got.ndim == 0
    expected = reference_sum(logits, LABELS)
    size = ce_size(expected, count_label_tokens(LABELS))
    assert_close(got, expected, terms=SUM_TERMS, magnitude=size, what="loss sum")
    # Per row too, so a bug that mixes rows cannot cancel out.
    for b in range(LABELS.shape[0]):
        row = token_cross_entropy_sum(logits[b : b + 1], LABELS[b : b + 1])
        want = reference_sum(logits[b : b + 1], LABELS[b : b + 1])
        size = ce_size(want, count_label_tokens(LABELS[b : b + 1]))
        assert_close(row, want, terms=SUM_TERMS, magnitude=size, what=f"row {b} loss sum")


@pytest.mark.numerics
def test_cross_entropy_sum_of_known_value():
    # Uniform logits: every label token costs log(V).
    logits = torch.zeros(1, 4, 5)
    labels = torch.tensor([[I, 1, 2, 3]])
    got = token_cross_entropy_sum(logits, labels)
    want = 3 * math.log(5)  # V 5, 3 label tokens
    assert_close(got, want, terms=5 + 3, magnitude=ce_size(want, 3), what="loss sum")


@pytest.mark.numerics
def test_cross_entropy_sum_upcasts_low_precision_logits():
    logits = random_logits(seed=1).to(torch.bfloat16)
    got = token_cross_entropy_sum(logits, LABELS)
    assert got.dtype == torch.float32
    # float32 rounding of the bf16 values: a sum in bf16 would be off by ~eps(bf16) = 7.8e-3.
    want = reference_sum(logits, LABELS)
    size = ce_size(want, count_label_tokens(LABELS))
    assert_close(got, want, terms=SUM_TERMS, magnitude=size, what="loss sum")


def test_cross_entropy_sum_with_no_label_tokens_is_zero():
    logits = random_logits()
    assert float(token_cross_entropy_sum(logits, torch.full((3, 6), I))) == 0.0


@pytest.mark.numerics
def test_causal_lm_loss_uses_the_model_logits():
    logits = random_logits(seed=2)
    seen = {}

    def model(input_ids, attention_mask, use_cache):
        seen["input_ids"], seen["attention_mask"] = input_ids, attention_mask
        seen["use_cache"] = use_cache
        return SimpleNamespace(logits=logits)

    batch = {
        "input_ids": torch.zeros(3, 6, dtype=torch.long),
        "attention_mask": torch.ones(3, 6, dtype=torch.long),
        "labels": LABELS,
    }
    loss_sum, metrics = causal_lm_loss(model, batch)
    assert metrics == {}
    assert seen["input_ids"] is batch["input_ids"]
    assert seen["attention_mask"] is batch["attention_mask"]
    assert seen["use_cache"] is False  # a cache would hide packed sample boundaries
    want = reference_sum(logits, LABELS)
    size = ce_size(want, count_label_tokens(LABELS))
    assert_close(loss_sum, want, terms=SUM_TERMS, magnitude=size, what="loss sum")


# ---- gradient accumulation ------------------------------------------------------------------


def linear_setup():
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(3, 6, 4, generator=generator)
    weight = torch.randn(4, 7, generator=generator)
    return features, weight


def grad_of(loss_fn, weight):
    weight = weight.clone().requires_grad_(True)
    loss_fn(weight)
    return weight.grad


def full_batch_mean_loss(features, weight):
    """Independent reference: transformers-style mean over all label tokens of the batch."""
    logits = features @ weight
    targets = shifted_labels(LABELS)
    loss = F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1), ignore_index=I)
    loss.backward()
    return loss


@pytest.mark.numerics
def test_accumulated_sums_equal_full_batch_mean_gradient():
    features, weight = linear_setup()
    n_total = count_label_tokens(LABELS)
    # Each gradient element is a mean over the label tokens of feature * (softmax - one-hot),
    # terms of either sign each below max|feature|; its chain: the 4 features of the matmul,
    # the softmax over V, the sum over the 18 positions.
    terms, size = 4 + V + LABELS.numel(), float(features.abs().max())

    def accumulated(w):
        for b in range(LABELS.shape[0]):  # micro-batches of one row, unequal token counts
            logits = features[b : b + 1] @ w
            (token_cross_entropy_sum(logits, LABELS[b : b + 1]) / n_total).backward()

    def naive(w):  # the classic mistake: mean per micro-batch, then averaged
        for b in range(LABELS.shape[0]):
            logits = features[b : b + 1] @ w
            row = LABELS[b : b + 1]
            loss = token_cross_entropy_sum(logits, row) / count_label_tokens(row)
            (loss / LABELS.shape[0]).backward()

    expected = grad_of(lambda w: full_batch_mean_loss(features, w), weight)
    got = grad_of(accumulated, weight)
    assert_close(got, expected, terms=terms, magnitude=size, what="accumulated gradient")
    # The check can tell: with unequal token counts the naive mean differs (by ~100x the bound).
    assert (grad_of(naive, weight) - expected).abs().max() > 1e-3

    # Split into micro-batches of 2 + 1 rows: same gradient.
    def two_micro_batches(w):
        for rows in (slice(0, 2), slice(2, 3)):
            loss_sum = token_cross_entropy_sum(features[rows] @ w, LABELS[rows])
            (loss_sum / n_total).backward()

    got = grad_of(two_micro_batches, weight)
    assert_close(got, expected, terms=terms, magnitude=size, what="2 + 1 rows gradient")


# ---- per-token and per-sequence losses ------------------------------------------------------


def reference_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[b, t] = -log softmax(logits[b, t])[labels[b, t + 1]], 0 where no label, float64."""
    out = torch.zeros(labels.shape, dtype=torch.float64)
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            target = int(labels[b, t + 1])
            if target != IGNORE_INDEX:
                row = logits[b, t].double()
                out[b, t] = torch.logsumexp(row, dim=0) - row[target]
    return out


@pytest.mark.numerics
def test_token_cross_entropy_matches_hand_written_reference():
    for logits in (random_logits(), random_logits(seed=1).to(torch.bfloat16)):
        got = token_cross_entropy(logits, LABELS)
        assert got.dtype == torch.float32 and got.shape == LABELS.shape
        expected = reference_token_losses(logits, LABELS)
        size = ce_size(expected.max(), 1)  # a log-softmax over V
        assert_close(got, expected, terms=V, magnitude=size, what="token losses")
        assert (got[shifted_labels(LABELS) == I] == 0).all()
        total = token_cross_entropy_sum(logits, LABELS)
        size = ce_size(total, count_label_tokens(LABELS))
        terms = V + LABELS.numel()
        assert_close(got.sum(), total, terms=terms, magnitude=size, what="sum of token losses")


def embedding_model(vocab=7, seed=0):
    """A 'model' whose logits at a position depend on that position's token only, so a
    sample's losses cannot depend on how it was batched."""
    table = random_logits((vocab, vocab), seed=seed)

    def model(input_ids, use_cache, attention_mask=None, position_ids=None):
        return SimpleNamespace(logits=table[input_ids])

    return model


@pytest.mark.numerics
def test_causal_lm_loss_token_reduction():
    model = embedding_model()
    batch = {"input_ids": LABELS.clamp(min=0), "labels": LABELS}
    losses, metrics = causal_lm_loss(model, batch, reduction="token")
    assert metrics == {} and losses.shape == LABELS.shape
    logits = model(batch["input_ids"], use_cache=False).logits
    expected = reference_token_losses(logits, LABELS)
    size = ce_size(expected.max(), 1)  # a log-softmax over V
    assert_close(losses, expected, terms=V, magnitude=size, what="token losses")
    with pytest.raises(ValueError, match="reduction must be one of"):
        causal_lm_loss(model, batch, reduction="mean")


def test_sequence_sums():
    losses = torch.tensor([[1.0, 2.0, 4.0, 8.0], [16.0, 32.0, 64.0, 128.0]], requires_grad=True)
    ids = torch.tensor([[0, 0, 1, -1], [2, 2, 2, -1]])
    sums = sequence_sums(losses, ids, 4)  # sample 3 has no position: sum 0
    assert sums.tolist() == [3.0, 4.0, 112.0, 0.0]
    (grad,) = torch.autograd.grad((sums * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum(), losses)
    assert grad.tolist() == [[1.0, 1.0, 2.0, 0.0], [3.0, 3.0, 3.0, 0.0]]
    with pytest.raises(ValueError, match="do not match"):
        sequence_sums(losses, ids[:, :3], 4)


SAMPLES = [
    {"input_ids": [1, 2, 3], "labels": [I, 2, 3]},
    {"input_ids": [4, 5, 6, 1, 2], "labels": [I, I, 6, 1, 2]},
    {"input_ids": [3, 3], "labels": [I, 5]},
]


def test_sequence_ids_of_padded_and_packed_batches():
    padded = collate(SAMPLES, pad_token_id=0)
    assert sequence_ids_from_batch(padded).tolist() == [
        [0, 0, 0, -1, -1],
        [1, 1, 1, 1, 1],
        [2, 2, -1, -1, -1],
    ]
    packed = collate_packed([SAMPLES[:1], SAMPLES[1:]], pad_token_id=0)
    assert packed["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3]  # padding restarts
    assert sequence_ids_from_batch(packed).tolist() == [
        [0, 0, 0, -1, -1, -1, -1],
        [1, 1, 1, 1, 1, 2, 2],
    ]
    assert count_sequences(sequence_ids_from_batch(packed)) == 3
    # No mask and no positions: each row is one sample.
    assert sequence_ids_from_batch({"labels": LABELS}).tolist() == [[0] * 6, [1] * 6, [2] * 6]
    padded["attention_mask"][1] = 0  # a row of padding only is no sample
    assert sequence_ids_from_batch(padded)[1:].tolist() == [[-1] * 5, [1, 1, -1, -1, -1]]
    assert count_sequences(torch.full((2, 3), -1)) == 0


@pytest.mark.numerics
@pytest.mark.parametrize("packed", [False, True])
def test_sequence_sums_of_a_batch_equal_sample_by_sample_sums(packed):
    model = embedding_model()
    expected = [float(causal_lm_loss(model, collate([s], 0))[0]) for s in SAMPLES]
    batch = collate_packed([SAMPLES[:2], SAMPLES[2:]], 0) if packed else collate(SAMPLES, 0)
    losses, _ = causal_lm_loss(model, batch, reduction="token")
    ids = sequence_ids_from_batch(batch)
    sums = sequence_sums(losses, ids, count_sequences(ids))
    assert sums.shape == (3,) and all(e > 0 for e in expected)
    terms = V + batch["labels"].shape[1]  # a log-softmax over V, a sum over a row's positions
    for got, want, sample in zip(sums.tolist(), expected, SAMPLES, strict=True):
        size = ce_size(want, len(sample["labels"]))
        assert_close(got, want, terms=terms, magnitude=size, what="sequence sum")
