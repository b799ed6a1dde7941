"""GRPO's loss pieces (losses/rl.py) against independent per-element implementations of the
formulas (plain Python math over lists), for every loss_type, both importance-sampling levels
and every advantage setting."""

import math
import statistics

import pytest
import torch

from swiftlm.losses.rl import (
    GRPO_LOSS_TYPES,
    STD_EPSILON,
    clipped_surrogate,
    group_advantages,
    k3_kl,
    normalizer,
    reduce_tokens,
)
from tolerance import assert_close

torch.manual_seed(0)
B, T, L = 4, 6, 8
LOGPS = (torch.randn(B, T) * 0.5 - 2).double()
OLD = (LOGPS + torch.randn(B, T) * 0.3).double()
REF = (LOGPS + torch.randn(B, T) * 0.2).double()
ADV = torch.tensor([1.5, -0.7, 0.0, -2.0], dtype=torch.float64)
MASK = torch.tensor(
    [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]]
)
MASK = MASK.double()


def reference_token_loss(logp, old, adv, low, high, seq_log_ratio=None) -> float:
    log_ratio = seq_log_ratio if seq_log_ratio is not None else logp - old
    ratio = math.exp(log_ratio)
    return -min(ratio * adv, min(max(ratio, 1 - low), 1 + high) * adv)


def reference_loss(loss_type, level, low=0.2, high=0.28, beta=0.0):
    """(loss sum, normalizer, magnitude) by hand, over lists. The magnitude behind the sum is,
    per token, the surrogate's size times 1 + |logp| + |old| (the log-ratio's difference rounds
    relative to those, and exp carries its error into the ratio), plus the k3 term's
    beta (e^d + |d| + 1) (it cancels to about d^2 / 2) times 1 + |ref| + |logp|."""
    per_row_sums, per_row_counts, per_row_sizes = [], [], []
    for i in range(B):
        tokens = [t for t in range(T) if MASK[i, t] == 1]
        seq = None
        if level == "sequence":
            seq = sum(float(LOGPS[i, t] - OLD[i, t]) for t in tokens) / len(tokens)
        values, sizes = [], []
        for t in tokens:
            logp, old, ref = float(LOGPS[i, t]), float(OLD[i, t]), float(REF[i, t])
            value = reference_token_loss(logp, old, float(ADV[i]), low, high, seq)
            d = ref - logp
            values.append(value + beta * (math.exp(d) - d - 1))
            sizes.append(
                abs(value) * (1 + abs(logp) + abs(old))
                + beta * (math.exp(d) + abs(d) + 1) * (1 + abs(ref) + abs(logp))
            )
        per_row_sums.append(sum(values))
        per_row_counts.append(len(values))
        per_row_sizes.append(sum(sizes))
    if loss_type == "grpo":
        means = sum(s / c for s, c in zip(per_row_sums, per_row_counts, strict=True))
        sizes = sum(z / c for z, c in zip(per_row_sizes, per_row_counts, strict=True))
        return means, B, sizes
    if loss_type == "dr_grpo":
        return sum(per_row_sums), B * L, sum(per_row_sizes)
    return sum(per_row_sums), sum(per_row_counts), sum(per_row_sizes)


@pytest.mark.numerics
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_the_loss_equals_the_formula(loss_type, level):
    beta = 0.04
    losses, _ = clipped_surrogate(
        LOGPS, OLD, ADV, MASK, epsilon_low=0.2, epsilon_high=0.28, level=level
    )
    losses = losses + beta * k3_kl(LOGPS, REF)
    got = reduce_tokens(losses, MASK, loss_type) / normalizer(MASK, torch.ones(B), loss_type, L)
    want_sum, want_units, size = reference_loss(loss_type, level, beta=beta)
    # float64; per token: the sequence mean of T log-ratios, exp, product, clip, min, k3's 3
    # terms; then the sums over T tokens and B rows.
    terms = 2 * T + B + 6
    assert_close(
        got, want_sum / want_units, terms=terms, magnitude=size / want_units,
        dtype=torch.float64, what="loss",
    )  # fmt: skip


@pytest.mark.numerics
def test_the_ratio_is_one_on_policy_so_the_loss_is_minus_the_mean_advantage():
    """With old == current (one optimizer step per generation) and zero-mean advantages per
    group the surrogate is 0: GRPO's logged loss hovers at 0 by construction."""
    losses, clipped = clipped_surrogate(LOGPS, LOGPS, ADV, MASK, epsilon_low=0.2, epsilon_high=0.2)
    per_row = reduce_tokens(losses, MASK, "grpo")
    # The ratio is exp(0) = 1 exactly: only the per-row means (T tokens) and their sum round.
    size = float(ADV.abs().sum())
    assert_close(
        per_row, -ADV.sum(), terms=T + B, magnitude=size, dtype=torch.float64, what="loss"
    )  # fmt: skip
    assert float(clipped.sum()) == 0


@pytest.mark.numerics
def test_the_gradient_on_policy_is_the_policy_gradient():
    """d loss / d logp_t = -A / |o| per token for loss_type grpo (the ratio's derivative is 1)."""
    logps = LOGPS.clone().requires_grad_(True)
    losses, _ = clipped_surrogate(
        logps, logps.detach(), ADV, MASK, epsilon_low=0.2, epsilon_high=0.2
    )
    reduce_tokens(losses, MASK, "grpo").backward()
    want = -ADV.unsqueeze(1) * MASK / MASK.sum(1, keepdim=True)
    # exp(0) = 1 exactly; the chain rule's products and the 1 / |o| round (3 terms), float64.
    assert_close(logps.grad, want, terms=3, dtype=torch.float64, what="gradient")


def test_clipping_flags_only_the_side_that_limits():
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]], dtype=torch.float64))
    old = torch.zeros_like(logps)
    mask = torch.ones_like(logps)
    _, up = clipped_surrogate(
        logps, old, torch.tensor([1.0]), mask, epsilon_low=0.2, epsilon_high=0.2
    )
    _, down = clipped_surrogate(
        logps, old, torch.tensor([-1.0]), mask, epsilon_low=0.2, epsilon_high=0.2
    )
    assert up.tolist() == [[1, 0, 1, 0]]  # ratio 1.5 > 1.2 with A > 0
    assert down.tolist() == [[0, 1, 0, 1]]  # ratio 0.5 < 0.8 with A < 0


def test_k3_is_zero_at_the_reference_and_positive_elsewhere():
    assert float(k3_kl(LOGPS, LOGPS).abs().max()) == 0
    assert bool((k3_kl(LOGPS, REF) > 0).all())


REWARDS = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.5, 2.0, -1.0, 0.25]])


@pytest.mark.numerics
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_the_formula(estimator, scale):
    batch_std = statistics.stdev(REWARDS.flatten().tolist())
    got = group_advantages(REWARDS, estimator=estimator, scale=scale, batch_std=batch_std)
    for g, row in enumerate(REWARDS.tolist()):
        for i, r in enumerate(row):
            others = row[:i] + row[i + 1 :]
            baseline = statistics.mean(row) if estimator == "grpo" else statistics.mean(others)
            value, divisor = r - baseline, 1.0
            if scale == "group":
                divisor = statistics.stdev(row) + STD_EPSILON
            elif scale == "batch":
                divisor = batch_std + STD_EPSILON
            value /= divisor
            # float32: the mean's and the variance's sums over the G rewards of the group, the
            # difference (relative to |r| + the mean of |r|), the sqrt, the G / (G - 1) and the
            # division (relative to the value).
            size = (abs(r) + statistics.mean(abs(x) for x in row)) / divisor + abs(value)
            terms = 2 * len(row) + 4
            assert_close(got[g, i], value, terms=terms, magnitude=size, what=f"advantage {g, i}")


def test_a_group_whose_rewards_agree_has_zero_advantages():
    assert group_advantages(REWARDS)[1].abs().max() == 0


def test_padding_rows_count_for_nothing_in_the_normalizer():
    weight = torch.tensor([1.0, 1.0, 0.0, 1.0])
    assert normalizer(MASK, weight, "grpo", L) == 3
    assert normalizer(MASK, weight, "dr_grpo", L) == 3 * L
    assert normalizer(MASK, weight, "dapo", L) == 6 + 3 + 1
