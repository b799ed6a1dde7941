"""Token losses: checked against a hand-written float64 reference; accumulation is exact."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from swiftlm.data.encode import IGNORE_INDEX
from swiftlm.losses.causal_lm import (
    causal_lm_loss,
    count_label_tokens,
    shifted_labels,
    token_cross_entropy_sum,
)

I = IGNORE_INDEX  # noqa: E741

LABELS = torch.tensor(
    [
        [I, I, 3, 5, I, 6],  # prompt masked, answer 3 5 / 6
        [1, 2, 0, 4, 4, 2],  # every token; the first label has nothing predicting it
        [I, I, I, I, 2, I],  # a single loss token
    ]
)


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


def test_cross_entropy_sum_matches_hand_written_reference():
    logits = random_logits()
    got = token_cross_entropy_sum(logits, LABELS)
    assert got.dtype == torch.float32 and got.ndim == 0
    expected = reference_sum(logits, LABELS)
    assert math.isclose(float(got), expected, rel_tol=1e-6)
    # Per row too, so a bug that mixes rows cannot cancel out.
    for b in range(LABELS.shape[0]):
        row = token_cross_entropy_sum(logits[b : b + 1], LABELS[b : b + 1])
        assert math.isclose(
            float(row), reference_sum(logits[b : b + 1], LABELS[b : b + 1]), rel_tol=1e-6
        )


def test_cross_entropy_sum_of_known_value():
    # Uniform logits: every label token costs log(V).
    logits = torch.zeros(1, 4, 5)
    labels = torch.tensor([[I, 1, 2, 3]])
    assert math.isclose(
        float(token_cross_entropy_sum(logits, labels)), 3 * math.log(5), rel_tol=1e-6
    )


def test_cross_entropy_sum_upcasts_low_precision_logits():
    logits = random_logits(seed=1).to(torch.bfloat16)
    got = token_cross_entropy_sum(logits, LABELS)
    assert got.dtype == torch.float32
    assert math.isclose(float(got), reference_sum(logits, LABELS), rel_tol=1e-6)


def test_cross_entropy_sum_with_no_label_tokens_is_zero():
    logits = random_logits()
    assert float(token_cross_entropy_sum(logits, torch.full((3, 6), I))) == 0.0


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
    assert math.isclose(float(loss_sum), reference_sum(logits, LABELS), rel_tol=1e-6)


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


def test_accumulated_sums_equal_full_batch_mean_gradient():
    features, weight = linear_setup()
    n_total = count_label_tokens(LABELS)

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
    assert torch.allclose(got, expected, rtol=0, atol=1e-6)
    # The check can tell: with unequal token counts the naive mean differs.
    assert (grad_of(naive, weight) - expected).abs().max() > 1e-3

    # Split into micro-batches of 2 + 1 rows: same gradient.
    def two_micro_batches(w):
        for rows in (slice(0, 2), slice(2, 3)):
            loss_sum = token_cross_entropy_sum(features[rows] @ w, LABELS[rows])
            (loss_sum / n_total).backward()

    assert torch.allclose(grad_of(two_micro_batches, weight), expected, rtol=0, atol=1e-6)
