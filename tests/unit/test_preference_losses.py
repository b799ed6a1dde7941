"""Preference losses: each checked against a scalar float64 reference written with `math`
from the papers' / TRL's formulas, plus the DPO fixed point ln 2, the loss_type error and
gradient flow."""

import math

import pytest
import torch

from swiftlm.losses.preference import (
    CPO_LOSS_TYPES,
    DPO_LOSS_TYPES,
    KTO_LOSS_TYPES,
    RunningMean,
    bco_batch_reward,
    cpo_losses,
    dpo_losses,
    dpo_rewards,
    kto_losses,
    orpo_losses,
    simpo_losses,
    weighted_dpo_losses,
)

B = 5
SEEDS = range(4)
BETAS = (0.1, 0.5)
SMOOTHINGS = (0.0, 0.2)
TOL = 1e-9


def sig(x):
    return 1 / (1 + math.exp(-x))


def logsig(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def smoothed(x, ls):
    return -(1 - ls) * logsig(x) - ls * logsig(-x)


def logps(seed, n=B, low=5.0, high=50.0):
    """n random sequence log-probs in [-high, -low], float64."""
    torch.manual_seed(seed)
    return -(low + (high - low) * torch.rand(n, dtype=torch.float64))


def pairs(seed):
    """Chosen, rejected, ref chosen, ref rejected: close log-probs (small differences)."""
    base = logps(seed)
    torch.manual_seed(1000 + seed)
    noise = torch.randn(4, B, dtype=torch.float64)
    return [base + 2.0 * noise[i] for i in range(4)]


def ref_dpo(c, r, c0, r0, beta, loss_type, ls, tau, shift=0.0):
    """The per-pair losses for lists of floats (aot sorts over the whole batch)."""
    n = len(c)
    uc = [c[i] - c0[i] for i in range(n)]
    ur = [r[i] - r0[i] for i in range(n)]
    if loss_type == "aot":
        a = sorted(c[i] - r[i] for i in range(n))
        b = sorted(c0[i] - r0[i] for i in range(n))
        return [smoothed(beta * (a[i] - b[i]), ls) for i in range(n)]
    if loss_type == "aot_pair":
        a, b = sorted(uc), sorted(ur)
        return [smoothed(beta * (a[i] - b[i]), ls) for i in range(n)]
    out = []
    for i in range(n):
        h = uc[i] - ur[i]
        z = beta * h
        if loss_type == "sigmoid":
            v = smoothed(z, ls)
        elif loss_type == "hinge":
            v = max(0.0, 1 - z)
        elif loss_type == "ipo":
            v = (h - 1 / (2 * beta)) ** 2
        elif loss_type == "robust":
            v = (-(1 - ls) * logsig(z) + ls * logsig(-z)) / (1 - 2 * ls)
        elif loss_type == "exo_pair":
            eps = ls if ls else 1e-3
            v = sig(z) * (logsig(z) - math.log(1 - eps)) + sig(-z) * (logsig(-z) - math.log(eps))
        elif loss_type == "nca_pair":
            v = -logsig(beta * uc[i]) - 0.5 * logsig(-beta * uc[i]) - 0.5 * logsig(-beta * ur[i])
        elif loss_type == "sppo_hard":
            v = (uc[i] - 0.5 / beta) ** 2 + (ur[i] + 0.5 / beta) ** 2
        elif loss_type == "apo_zero":
            v = 1 - sig(beta * uc[i]) + sig(beta * ur[i])
        elif loss_type == "apo_down":
            v = sig(beta * uc[i]) + 1 - sig(z)
        elif loss_type == "discopop":
            m = sig(z / tau)
            v = -logsig(z) * (1 - m) + math.exp(-z) * m
        elif loss_type == "bco_pair":
            v = -logsig(beta * uc[i] - shift) - logsig(-(beta * ur[i] - shift))
        out.append(v)
    return out


def assert_close(got: torch.Tensor, expected: list[float]):
    assert got.shape == (len(expected),)
    for g, e in zip(got.tolist(), expected, strict=True):
        assert abs(g - e) <= TOL, (g, e)


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_losses_match_scalar_reference(loss_type):
    for seed in SEEDS:
        tensors = pairs(seed)
        floats = [t.tolist() for t in tensors]
        for beta in BETAS:
            for ls in SMOOTHINGS:
                tau = 0.05 if seed % 2 else 0.5
                got = dpo_losses(
                    *tensors, beta=beta, loss_type=loss_type, label_smoothing=ls, discopop_tau=tau
                )
                assert got.dtype == torch.float64
                assert_close(got, ref_dpo(*floats, beta, loss_type, ls, tau))


def test_dpo_sigmoid_at_reference_is_ln2():
    torch.manual_seed(0)
    c = -(5 + 45 * torch.rand(8))
    r = -(5 + 45 * torch.rand(8))
    loss = dpo_losses(c, r, c.clone(), r.clone(), beta=0.1)
    assert loss.dtype == torch.float32
    assert torch.allclose(loss, torch.full_like(loss, math.log(2)), rtol=0, atol=1e-6)


def test_dpo_unknown_loss_type_names_accepted():
    c = torch.zeros(2)
    with pytest.raises(ValueError) as info:
        dpo_losses(c, c, c, c, beta=0.1, loss_type="bogus")
    message = str(info.value)
    assert "bogus" in message
    for name in DPO_LOSS_TYPES:
        assert repr(name) in message
    with pytest.raises(ValueError, match="hinge"):
        cpo_losses(c, c, beta=0.1, loss_type="simpo")


def test_dpo_rewards_detached():
    c, _, c0, _ = pairs(0)
    c.requires_grad_(True)
    rewards = dpo_rewards(c, c0, 0.25)
    assert not rewards.requires_grad
    assert_close(rewards, [0.25 * (a - b) for a, b in zip(c.tolist(), c0.tolist(), strict=True)])


def test_simpo_and_cpo_match_scalar_reference():
    for seed in SEEDS:
        c, r = logps(seed) / 40, logps(seed + 100) / 40  # average log-probs
        cf, rf = c.tolist(), r.tolist()
        for beta in BETAS:
            for ls in SMOOTHINGS:
                got = simpo_losses(c, r, beta=beta, gamma=0.5, label_smoothing=ls)
                h = [a - b - 0.5 / beta for a, b in zip(cf, rf, strict=True)]
                assert_close(got, [smoothed(beta * x, ls) for x in h])
                d = [a - b for a, b in zip(cf, rf, strict=True)]
                got = cpo_losses(c, r, beta=beta, label_smoothing=ls)
                assert_close(got, [smoothed(beta * x, ls) for x in d])
            got = cpo_losses(c, r, beta=beta, loss_type="hinge")
            assert_close(got, [max(0.0, 1 - beta * x) for x in d])
            got = cpo_losses(c, r, beta=beta, loss_type="ipo")
            assert_close(got, [(x - 1 / (2 * beta)) ** 2 for x in d])


def test_orpo_matches_scalar_reference():
    def log_odds(x):
        return x - math.log1p(-math.exp(x))

    for seed in SEEDS:
        # average log-probs, down to ~1e-4 where log(1 - exp(x)) needs care
        c = logps(seed, low=1e-4, high=3.0)
        r = logps(seed + 100, low=1e-4, high=3.0)
        for beta in BETAS:
            got = orpo_losses(c, r, beta=beta)
            expected = [
                -beta * logsig(log_odds(a) - log_odds(b))
                for a, b in zip(c.tolist(), r.tolist(), strict=True)
            ]
            assert_close(got, expected)


def test_kto_matches_scalar_reference():
    for seed in SEEDS:
        policy, ref = logps(seed), logps(seed) + 0.5 * torch.randn(B, dtype=torch.float64)
        desirable = torch.rand(B) < 0.5
        kl = torch.tensor(0.3 * seed, dtype=torch.float64)
        for beta in BETAS:
            got = kto_losses(
                policy, ref, kl, desirable, beta=beta, desirable_weight=1.5, undesirable_weight=0.7
            )
            expected = []
            for p, q, d in zip(policy.tolist(), ref.tolist(), desirable.tolist(), strict=True):
                u, k = p - q, float(kl)
                expected.append(
                    1.5 * (1 - sig(beta * (u - k))) if d else 0.7 * (1 - sig(beta * (k - u)))
                )
            assert_close(got, expected)


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_gradients_flow(loss_type):
    c, r, c0, r0 = (t.float() for t in pairs(1))
    c.requires_grad_(True)
    dpo_losses(c, r, c0, r0, beta=0.1, loss_type=loss_type).sum().backward()
    assert c.grad is not None and torch.isfinite(c.grad).all()


def test_other_losses_gradients_flow():
    c, r = logps(2).float() / 40, logps(3).float() / 40
    c.requires_grad_(True)
    total = (
        simpo_losses(c, r, beta=2.0, gamma=0.5).sum()
        + cpo_losses(c, r, beta=0.1).sum()
        + orpo_losses(c, r, beta=0.1).sum()
        + kto_losses(
            c, r, torch.tensor(0.1), torch.tensor([True, False] * 2 + [True]), beta=0.1
        ).sum()
    )
    total.backward()
    assert torch.isfinite(c.grad).all() and c.grad.abs().sum() > 0
    # log(1 - exp(x)) near 0 and far below it: no NaN from the branch that is not taken
    x = torch.tensor([-1e-6, -60.0], requires_grad=True)
    orpo_losses(x, torch.tensor([-2.0, -1.0]), beta=0.1).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_the_loss_type_flag_offers_exactly_the_implemented_losses():
    from swiftlm.config import sections_rlhf

    assert sections_rlhf.DPO_LOSS_TYPES == DPO_LOSS_TYPES
    assert sections_rlhf.LOSS_TYPES["cpo"] == CPO_LOSS_TYPES
    assert sections_rlhf.LOSS_TYPES["kto"] == KTO_LOSS_TYPES


def test_bco_pair_with_a_shift_matches_scalar_reference():
    for seed in SEEDS:
        tensors = pairs(seed)
        floats = [t.tolist() for t in tensors]
        for beta in BETAS:
            for shift in (-0.7, 0.0, 1.3):
                got = dpo_losses(*tensors, beta=beta, loss_type="bco_pair", bco_shift=shift)
                assert_close(got, ref_dpo(*floats, beta, "bco_pair", 0.0, 0.05, shift))


def test_bco_batch_reward_is_the_mean_over_both_answers_without_padding():
    c, r, c0, r0 = pairs(2)
    beta = 0.2
    policy, reference = c.tolist() + r.tolist(), c0.tolist() + r0.tolist()
    rewards = [beta * (a - b) for a, b in zip(policy, reference, strict=True)]
    assert bco_batch_reward(c, r, c0, r0, beta=beta).item() == pytest.approx(
        sum(rewards) / len(rewards), abs=TOL
    )
    weight = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])  # pairs 2 and 4 are padding
    kept = [rewards[i] for i in (0, 1, 3)] + [rewards[B + i] for i in (0, 1, 3)]
    got = bco_batch_reward(c, r, c0, r0, beta=beta, weight=weight).item()
    assert got == pytest.approx(sum(kept) / 6, abs=TOL)


def test_running_mean_is_the_average_of_the_values_seen():
    """TRL's RunningMoments with a count of 1 per update and an initial count of 1e-24."""
    values = [0.5, -1.25, 2.0, 0.125]
    running, trl_mean, trl_count = RunningMean(), 0.0, 1e-24
    for k, value in enumerate(values, start=1):
        got = running.update(value)
        delta = value - trl_mean
        trl_count, trl_mean = trl_count + 1, trl_mean + delta * 1 / (trl_count + 1)
        assert got == pytest.approx(sum(values[:k]) / k, abs=1e-12)
        assert got == pytest.approx(trl_mean, abs=1e-12)


def test_weighted_dpo_losses_are_the_weighted_sum_of_each_loss():
    tensors = pairs(3)
    got = weighted_dpo_losses(
        *tensors, loss_types=["sigmoid", "bco_pair"], loss_weights=[0.8, 0.2], beta=0.1,
        bco_shift=0.4,
    )  # fmt: skip
    sigmoid = dpo_losses(*tensors, beta=0.1, loss_type="sigmoid")
    bco = dpo_losses(*tensors, beta=0.1, loss_type="bco_pair", bco_shift=0.4)
    assert torch.allclose(got, 0.8 * sigmoid + 0.2 * bco, rtol=0, atol=TOL)
    alone = weighted_dpo_losses(*tensors, loss_types=["hinge"], beta=0.1)
    assert torch.equal(alone, dpo_losses(*tensors, beta=0.1, loss_type="hinge"))


def test_apo_zero_unpaired_matches_scalar_reference_and_ignores_the_kl():
    for seed in SEEDS:
        policy, ref = logps(seed), logps(seed) + 0.5 * torch.randn(B, dtype=torch.float64)
        desirable = torch.rand(B) < 0.5
        for beta in BETAS:
            got = kto_losses(
                policy, ref, torch.tensor(5.0, dtype=torch.float64), desirable, beta=beta,
                desirable_weight=1.5, undesirable_weight=0.7, loss_type="apo_zero_unpaired",
            )  # fmt: skip
            expected = [
                1.5 * (1 - sig(beta * (p - q))) if d else 0.7 * sig(beta * (p - q))
                for p, q, d in zip(policy.tolist(), ref.tolist(), desirable.tolist(), strict=True)
            ]
            assert_close(got, expected)
    with pytest.raises(ValueError, match="apo_zero_unpaired"):
        kto_losses(policy, ref, torch.tensor(0.0), desirable, beta=0.1, loss_type="sigmoid")
