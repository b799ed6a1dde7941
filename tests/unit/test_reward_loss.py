"""The Bradley-Terry reward-model loss against a scalar float64 reference written with `math`,
its value at equal rewards (ln 2), finiteness at extreme gaps and its gradient."""

import math

import pytest
import torch

from swiftlm.losses.reward import bradley_terry_losses
from tolerance import assert_close


def by_hand(c: float, r: float, m: float) -> float:
    """-log(1 / (1 + exp(-(c - r - m)))), with the stable branch for large negative gaps."""
    z = c - r - m
    return math.log1p(math.exp(-z)) if z > -30 else -z + math.log1p(math.exp(z))


@pytest.mark.numerics
@pytest.mark.parametrize("seed", range(3))
def test_matches_the_scalar_formula_with_and_without_margins(seed):
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randn(6, generator=g, dtype=torch.float64) * 3
    rejected = torch.randn(6, generator=g, dtype=torch.float64) * 3
    margin = torch.rand(6, generator=g, dtype=torch.float64) * 2
    for m in (margin, 0.0):
        got = bradley_terry_losses(chosen, rejected, m)
        ms = m.tolist() if isinstance(m, torch.Tensor) else [m] * 6
        expected = [
            by_hand(c, r, k) for c, r, k in zip(chosen.tolist(), rejected.tolist(), ms, strict=True)
        ]
        # float64: two differences, an exp and a log1p; the loss's slope is at most 1, so the
        # differences' roundings (relative to |c| + |r| + |m|) carry into it at most whole.
        size = float((chosen.abs() + rejected.abs() + m).max()) + max(expected)
        assert_close(got, expected, terms=4, magnitude=size, dtype=torch.float64, what="loss")


@pytest.mark.numerics
def test_equal_rewards_give_ln2_and_extreme_gaps_stay_finite():
    zero = torch.zeros(3)
    # 0 - 0 is exact: only the softplus of 0 rounds.
    assert_close(bradley_terry_losses(zero, zero), [math.log(2)] * 3, terms=1, what="ln 2")
    far = bradley_terry_losses(torch.tensor([-500.0, 500.0]), torch.tensor([500.0, -500.0]))
    assert torch.isfinite(far).all()
    # softplus(1000) = 1000 and softplus(-1000) = exp(-1000) = 0 in float32.
    assert_close(far, [1000.0, 0.0], terms=2, magnitude=1000.0, what="extreme gaps")


@pytest.mark.numerics
def test_the_gradient_raises_the_chosen_reward_and_lowers_the_rejected_one():
    chosen, rejected = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    bradley_terry_losses(chosen, rejected, torch.tensor([0.0, 1.0])).sum().backward()
    # d/dc softplus(-(c - r - m)) = -sigma(-(c - r - m)): -1/2 at 0, -sigma(1) with margin 1
    want = [0.5, 1 / (1 + math.exp(-1))]  # an exp, a sum, a quotient
    assert_close(chosen.grad, [-w for w in want], terms=3, what="chosen gradient")
    assert_close(rejected.grad, want, terms=3, what="rejected gradient")
