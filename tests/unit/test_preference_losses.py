"""Preference losses: each checked against a scalar float64 reference written with `math`
from the papers' / TRL's formulas, plus the DPO fixed point ln 2, the loss_type error and
gradient flow."""

import math

import pytest
import torch

from swiftlm.losses.preference import (
    DPO_LOSS_TYPES,
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
from tolerance import assert_close

B = 5
SEEDS = range(4)
BETAS = (0.1, 0.5)
SMOOTHINGS = (0.0, 0.2)

# Each loss is a short float64 chain on log-probs of size up to 50: the log-ratios' differences
# (3 additions), the scaling, a log-sigmoid's exp and log1p, a two-term smoothing or weighting:
# at most 8 roundings deep (the references' chains are the same formulas, written with `math`).
TERMS = 8


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


def magnitude(loss_fn, inputs, extra: float = 0.0) -> float:
    """What the rounding of a loss is relative to: its own size, plus each input's size carried
    by the loss's slope, sum |dL/dx| |x| (a rounding relative to the inputs, as in their
    differences, moves the loss by that), plus `extra` for a cancellation inside the formula."""
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    losses = loss_fn(*xs)
    grads = torch.autograd.grad(losses.sum(), xs)
    carried = sum(float((g * x.detach()).abs().sum()) for g, x in zip(grads, xs, strict=True))
    return float(losses.detach().abs().max()) + carried + extra


def check(loss_fn, inputs, expected: list[float], what: str, extra: float = 0.0):
    """Assert loss_fn(*inputs) (float64) equals the scalar reference up to its rounding."""
    got = loss_fn(*inputs)
    assert got.shape == (len(expected),) and got.dtype == torch.float64
    size = magnitude(loss_fn, inputs, extra)
    assert_close(got, expected, terms=TERMS, magnitude=size, dtype=torch.float64, what=what)


@pytest.mark.numerics
@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_losses_match_scalar_reference(loss_type):
    for seed in SEEDS:
        tensors = pairs(seed)
        floats = [t.tolist() for t in tensors]
        for beta in BETAS:
            for ls in SMOOTHINGS:
                tau = 0.05 if seed % 2 else 0.5

                def loss(*xs, beta=beta, ls=ls, tau=tau):
                    return dpo_losses(
                        *xs, beta=beta, loss_type=loss_type, label_smoothing=ls, discopop_tau=tau
                    )

                expected = ref_dpo(*floats, beta, loss_type, ls, tau)
                check(loss, tensors, expected, f"{loss_type} seed {seed} beta {beta} ls {ls}")


@pytest.mark.numerics
def test_dpo_sigmoid_at_reference_is_ln2():
    torch.manual_seed(0)
    c = -(5 + 45 * torch.rand(8))
    r = -(5 + 45 * torch.rand(8))
    loss = dpo_losses(c, r, c.clone(), r.clone(), beta=0.1)
    assert loss.dtype == torch.float32
    # The log-ratios cancel exactly (x - x = 0): only the log-sigmoid of 0 rounds.
    assert_close(loss, [math.log(2)] * 8, terms=1, what="loss at the reference")


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


@pytest.mark.numerics
def test_dpo_rewards_detached():
    c, _, c0, _ = pairs(0)
    c.requires_grad_(True)
    rewards = dpo_rewards(c, c0, 0.25)
    assert not rewards.requires_grad
    expected = [0.25 * (a - b) for a, b in zip(c.tolist(), c0.tolist(), strict=True)]
    size = float(0.25 * (c.detach().abs() + c0.abs()).max())  # one difference, one product
    assert_close(rewards, expected, terms=2, magnitude=size, dtype=torch.float64, what="rewards")


@pytest.mark.numerics
def test_simpo_and_cpo_match_scalar_reference():
    for seed in SEEDS:
        c, r = logps(seed) / 40, logps(seed + 100) / 40  # average log-probs
        cf, rf = c.tolist(), r.tolist()
        for beta in BETAS:
            for ls in SMOOTHINGS:
                h = [a - b - 0.5 / beta for a, b in zip(cf, rf, strict=True)]
                check(
                    lambda c, r, beta=beta, ls=ls: simpo_losses(
                        c, r, beta=beta, gamma=0.5, label_smoothing=ls
                    ),
                    [c, r], [smoothed(beta * x, ls) for x in h], "simpo",
                )  # fmt: skip
                d = [a - b for a, b in zip(cf, rf, strict=True)]
                check(
                    lambda c, r, beta=beta, ls=ls: cpo_losses(c, r, beta=beta, label_smoothing=ls),
                    [c, r], [smoothed(beta * x, ls) for x in d], "cpo",
                )  # fmt: skip
            check(
                lambda c, r, beta=beta: cpo_losses(c, r, beta=beta, loss_type="hinge"),
                [c, r], [max(0.0, 1 - beta * x) for x in d], "cpo hinge",
            )  # fmt: skip
            check(
                lambda c, r, beta=beta: cpo_losses(c, r, beta=beta, loss_type="ipo"),
                [c, r], [(x - 1 / (2 * beta)) ** 2 for x in d], "cpo ipo",
            )  # fmt: skip


@pytest.mark.numerics
def test_orpo_matches_scalar_reference():
    def log_odds(x):
        return x - math.log1p(-math.exp(x))

    for seed in SEEDS:
        # average log-probs, down to ~1e-4 where log(1 - exp(x)) needs care
        c = logps(seed, low=1e-4, high=3.0)
        r = logps(seed + 100, low=1e-4, high=3.0)
        for beta in BETAS:
            expected = [
                -beta * logsig(log_odds(a) - log_odds(b))
                for a, b in zip(c.tolist(), r.tolist(), strict=True)
            ]
            # The reference's log1p(-exp(x)) subtracts from 1 a number near 1 (the 2 of what is
            # added), which the log then divides by 1 - exp(x): a rounding of 2 / (1 - exp(x)),
            # scaled by beta and the log-sigmoid's slope (at most 1).
            cancelled = float(beta * (2 / -torch.expm1(c) + 2 / -torch.expm1(r)).max())
            check(
                lambda c, r, beta=beta: orpo_losses(c, r, beta=beta),
                [c, r], expected, f"orpo seed {seed}", extra=cancelled,
            )  # fmt: skip


@pytest.mark.numerics
def test_kto_matches_scalar_reference():
    for seed in SEEDS:
        policy, ref = logps(seed), logps(seed) + 0.5 * torch.randn(B, dtype=torch.float64)
        desirable = torch.rand(B) < 0.5
        kl = torch.tensor(0.3 * seed, dtype=torch.float64)
        for beta in BETAS:

            def loss(policy, ref, kl, beta=beta, desirable=desirable):
                return kto_losses(
                    policy, ref, kl, desirable, beta=beta, desirable_weight=1.5,
                    undesirable_weight=0.7,
                )  # fmt: skip

            expected = []
            for p, q, d in zip(policy.tolist(), ref.tolist(), desirable.tolist(), strict=True):
                u, k = p - q, float(kl)
                expected.append(
                    1.5 * (1 - sig(beta * (u - k))) if d else 0.7 * (1 - sig(beta * (k - u)))
                )
            check(loss, [policy, ref, kl], expected, f"kto seed {seed} beta {beta}")


def assert_gradients_match_finite_differences(loss, *inputs):
    """The float64 gradients of `loss` (each element's, for every input) against central finite
    differences: torch.autograd.gradcheck, step 1e-6, within 1e-5 + 1e-3 of the value. The
    differences' own error (truncation ~1e-12 times a third derivative, rounding ~1e-16 / 1e-6)
    is far below that; a wrong sign, factor or missing term is not."""
    inputs = [x.detach().double().requires_grad_(True) for x in inputs]
    assert torch.autograd.gradcheck(loss, inputs)


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_gradients_flow(loss_type):
    c, r, c0, r0 = pairs(1)

    def loss(c, r):
        return dpo_losses(c, r, c0, r0, beta=0.1, loss_type=loss_type)

    assert_gradients_match_finite_differences(loss, c, r)
    c, r, c0, r0 = (t.float() for t in pairs(1))  # and finite in float32, as training runs
    c.requires_grad_(True)
    dpo_losses(c, r, c0, r0, beta=0.1, loss_type=loss_type).sum().backward()
    assert c.grad is not None and torch.isfinite(c.grad).all()


def test_other_losses_gradients_flow():
    c, r = logps(2) / 40, logps(3) / 40
    desirable = torch.tensor([True, False] * 2 + [True])
    kl = torch.tensor(0.1, dtype=torch.float64)
    assert_gradients_match_finite_differences(
        lambda c, r: simpo_losses(c, r, beta=2.0, gamma=0.5), c, r
    )
    assert_gradients_match_finite_differences(lambda c, r: cpo_losses(c, r, beta=0.1), c, r)
    assert_gradients_match_finite_differences(lambda c, r: orpo_losses(c, r, beta=0.1), c, r)
    assert_gradients_match_finite_differences(
        lambda c: kto_losses(c, r, kl, desirable, beta=0.1), c
    )
    c, r = logps(2).float() / 40, logps(3).float() / 40  # and finite in float32
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


@pytest.mark.numerics
def test_bco_pair_with_a_shift_matches_scalar_reference():
    for seed in SEEDS:
        tensors = pairs(seed)
        floats = [t.tolist() for t in tensors]
        for beta in BETAS:
            for shift in (-0.7, 0.0, 1.3):
                check(
                    lambda *xs, beta=beta, shift=shift: dpo_losses(
                        *xs, beta=beta, loss_type="bco_pair", bco_shift=shift
                    ),
                    tensors, ref_dpo(*floats, beta, "bco_pair", 0.0, 0.05, shift),
                    f"bco_pair shift {shift}",
                )  # fmt: skip


@pytest.mark.numerics
def test_bco_batch_reward_is_the_mean_over_both_answers_without_padding():
    c, r, c0, r0 = pairs(2)
    beta = 0.2
    policy, reference = c.tolist() + r.tolist(), c0.tolist() + r0.tolist()
    rewards = [beta * (a - b) for a, b in zip(policy, reference, strict=True)]
    # A mean of 2B rewards of either sign, each a scaled difference: its magnitude is the mean
    # of beta (|a| + |b|); its chain the difference, the product and the sum of 2B values.
    size = beta * sum(abs(a) + abs(b) for a, b in zip(policy, reference, strict=True)) / (2 * B)
    terms = 2 + 2 * B
    got = bco_batch_reward(c, r, c0, r0, beta=beta)
    want = sum(rewards) / len(rewards)
    assert_close(got, want, terms=terms, magnitude=size, dtype=torch.float64, what="mean reward")
    weight = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])  # pairs 2 and 4 are padding
    kept = [rewards[i] for i in (0, 1, 3)] + [rewards[B + i] for i in (0, 1, 3)]
    got = bco_batch_reward(c, r, c0, r0, beta=beta, weight=weight)
    # (the mean over the 2B values bounds the 6 kept ones' mean times 2B / 6)
    size, want = size * 2 * B / 6, sum(kept) / 6
    assert_close(got, want, terms=terms, magnitude=size, dtype=torch.float64, what="kept mean")


@pytest.mark.numerics
def test_running_mean_is_the_average_of_the_values_seen():
    """TRL's RunningMoments with a count of 1 per update and an initial count of 1e-24."""
    values = [0.5, -1.25, 2.0, 0.125]
    # Each update adds (x - mean) / k, both below 2 max|x|: 3 roundings an update, float64.
    size, terms = 2 * max(abs(v) for v in values), 3 * len(values)
    running, trl_mean, trl_count = RunningMean(), 0.0, 1e-24
    for k, value in enumerate(values, start=1):
        got = running.update(value)
        delta = value - trl_mean
        trl_count, trl_mean = trl_count + 1, trl_mean + delta * 1 / (trl_count + 1)
        for want in (sum(values[:k]) / k, trl_mean):
            assert_close(
                got, want, terms=terms, magnitude=size, dtype=torch.float64, what=f"mean of {k}"
            )


def test_weighted_dpo_losses_are_the_weighted_sum_of_each_loss():
    tensors = pairs(3)
    got = weighted_dpo_losses(
        *tensors, loss_types=["sigmoid", "bco_pair"], loss_weights=[0.8, 0.2], beta=0.1,
        bco_shift=0.4,
    )  # fmt: skip
    sigmoid = dpo_losses(*tensors, beta=0.1, loss_type="sigmoid")
    bco = dpo_losses(*tensors, beta=0.1, loss_type="bco_pair", bco_shift=0.4)
    # The same products and the same sum in the same order: bit for bit.
    assert torch.equal(got, 0.8 * sigmoid + 0.2 * bco)
    alone = weighted_dpo_losses(*tensors, loss_types=["hinge"], beta=0.1)
    assert torch.equal(alone, dpo_losses(*tensors, beta=0.1, loss_type="hinge"))


@pytest.mark.numerics
def test_apo_zero_unpaired_matches_scalar_reference_and_ignores_the_kl():
    for seed in SEEDS:
        policy, ref = logps(seed), logps(seed) + 0.5 * torch.randn(B, dtype=torch.float64)
        desirable = torch.rand(B) < 0.5
        for beta in BETAS:

            def loss(policy, ref, beta=beta, desirable=desirable):
                return kto_losses(
                    policy, ref, torch.tensor(5.0, dtype=torch.float64), desirable, beta=beta,
                    desirable_weight=1.5, undesirable_weight=0.7, loss_type="apo_zero_unpaired",
                )  # fmt: skip

            expected = [
                1.5 * (1 - sig(beta * (p - q))) if d else 0.7 * sig(beta * (p - q))
                for p, q, d in zip(policy.tolist(), ref.tolist(), desirable.tolist(), strict=True)
            ]
            check(loss, [policy, ref], expected, f"apo_zero_unpaired seed {seed}")
    with pytest.raises(ValueError, match="apo_zero_unpaired"):
        kto_losses(policy, ref, torch.tensor(0.0), desirable, beta=0.1, loss_type="sigmoid")
