"""The generalized JSD of GKD against a scalar float64 reference written with `math` from the
paper's Eq. 1 and TRL's end-point convention, for beta 0, 0.5, 1 (and 0.1), temperatures,
top-k, the mask, TRL's own formula and gradient flow."""

import math

import pytest
import torch

from swiftlm.losses.distill import generalized_jsd_loss
from tolerance import assert_close

B, T, V = 2, 3, 7
# A position's loss: the two log-softmaxes (a sum over V), the mixture's log-sum-exp of 2, the
# divergence's sum over V. Its terms p (log p - log q) are of either sign, and a log-prob's
# rounding is relative to |log p| + 1 (the log of a sum >= 1), so its magnitude is
# sum_v (p_s + p_t) (|log p_s| + |log p_t| + 2) (`size`); the mixture's |log m| is below that.
TERMS = 2 * V + 2


def _softmax(values: list[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return [e / sum(exps) for e in exps]


def _kl(p: list[float], q: list[float]) -> float:
    return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q, strict=True) if pi > 0)


def _distributions(student: list[float], teacher: list[float], temperature: float,
                   top_k: int | None = None) -> tuple[list[float], list[float]]:  # fmt: skip
    if top_k is not None:
        order = sorted(range(len(teacher)), key=lambda v: -teacher[v])[:top_k]
        student, teacher = [student[v] for v in order], [teacher[v] for v in order]
    p_s = _softmax([x / temperature for x in student])
    return p_s, _softmax([x / temperature for x in teacher])


def size(student: list[float], teacher: list[float], temperature: float = 1.0,
         top_k: int | None = None) -> float:  # fmt: skip
    """The magnitude behind one position's loss (see TERMS)."""
    p_s, p_t = _distributions(student, teacher, temperature, top_k)
    return sum(
        (s + t) * (abs(math.log(s)) + abs(math.log(t)) + 2) for s, t in zip(p_s, p_t, strict=True)
    )


def reference(student: list[float], teacher: list[float], beta: float, temperature: float,
              top_k: int | None = None) -> float:  # fmt: skip
    """One position, plain per-element math."""
    p_s, p_t = _distributions(student, teacher, temperature, top_k)
    if beta == 0:
        return _kl(p_t, p_s)
    if beta == 1:
        return _kl(p_s, p_t)
    m = [beta * t + (1 - beta) * s for s, t in zip(p_s, p_t, strict=True)]
    return beta * _kl(p_t, m) + (1 - beta) * _kl(p_s, m)


def _logits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    return student, teacher, mask


@pytest.mark.numerics
@pytest.mark.parametrize("top_k", [None, 3])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 1.0])
def test_matches_the_per_element_formula(beta, temperature, top_k):
    for seed in range(3):
        student, teacher, mask = _logits(seed)
        got = generalized_jsd_loss(student, teacher, mask, beta, temperature, top_k)
        assert got.shape == (B, T)
        for b in range(B):
            for t in range(T):
                s, q = student[b, t].tolist(), teacher[b, t].tolist()
                want = reference(s, q, beta, temperature, top_k) if mask[b, t] else 0.0
                assert_close(
                    got[b, t], want, terms=TERMS, magnitude=size(s, q, temperature, top_k),
                    what=f"seed {seed} position {b, t}",
                )  # fmt: skip


@pytest.mark.numerics
def test_beta_0_is_forward_kl_and_1_reverse_kl():
    student, teacher, mask = _logits(7)
    forward = generalized_jsd_loss(student, teacher, mask, 0.0)
    reverse = generalized_jsd_loss(student, teacher, mask, 1.0)
    p_t, log_t = teacher.softmax(-1), teacher.log_softmax(-1)
    p_s, log_s = student.softmax(-1), student.log_softmax(-1)
    pairs = zip(student.flatten(0, 1).tolist(), teacher.flatten(0, 1).tolist(), strict=True)
    most = max(size(s, t) for s, t in pairs)
    want = (p_t * (log_t - log_s)).sum(-1) * mask
    assert_close(forward, want, terms=TERMS, magnitude=most, what="forward KL")
    want = (p_s * (log_s - log_t)).sum(-1) * mask
    assert_close(reverse, want, terms=TERMS, magnitude=most, what="reverse KL")
    assert not torch.allclose(forward, reverse)


@pytest.mark.numerics
def test_equals_trl_generalized_jsd_loss_summed():
    """TRL's formula (gkd_trainer.generalized_jsd_loss, copied: kl_div with the mixture)."""
    import torch.nn.functional as F

    student, teacher, mask = _logits(3)
    beta, temperature = 0.3, 0.9
    log_s = F.log_softmax(student / temperature, -1)
    log_t = F.log_softmax(teacher / temperature, -1)
    b = torch.tensor(beta, dtype=log_s.dtype)
    log_m = torch.logsumexp(torch.stack([log_s + torch.log1p(-b), log_t + torch.log(b)]), 0)
    jsd = beta * F.kl_div(log_m, log_t, reduction="none", log_target=True) + (1 - beta) * F.kl_div(
        log_m, log_s, reduction="none", log_target=True
    )
    trl = jsd.sum(-1)[mask.bool()].sum()
    ours = generalized_jsd_loss(student, teacher, mask, beta, temperature).sum()
    kept = zip(student[mask.bool()].tolist(), teacher[mask.bool()].tolist(), strict=True)
    total = sum(size(s, t, temperature) for s, t in kept)
    terms = TERMS + int(mask.sum())  # and the sum over the kept positions
    assert_close(ours, trl, terms=terms, magnitude=total, what="summed loss")


@pytest.mark.numerics
def test_identical_distributions_give_zero_and_gradients_reach_the_student_only():
    student, _, mask = _logits(1)
    rows = student.flatten(0, 1).tolist()
    most = max(size(s, s) for s in rows)
    student = student.float().requires_grad_(True)
    teacher = student.detach().clone()
    for beta in (0.0, 0.5, 1.0):
        same = generalized_jsd_loss(student, teacher, mask, beta).detach()
        # 0 in exact numbers (bit for bit for beta 0 and 1; the mixture of beta 0.5 rounds)
        zero = torch.zeros_like(same)
        assert_close(same, zero, terms=TERMS, magnitude=most, what=f"beta {beta} divergence")
    other = torch.randn(B, T, V)
    generalized_jsd_loss(student, other, mask, 0.5, top_k=4).sum().backward()
    assert student.grad is not None and float(student.grad[1, 0].abs().max()) == 0.0  # masked
    assert float(student.grad[0, 0].abs().max()) > 0


def test_top_k_at_least_the_vocabulary_is_the_whole_distribution():
    student, teacher, mask = _logits(2)
    whole = generalized_jsd_loss(student, teacher, mask, 0.5)
    # Nothing to select: the same arithmetic as without top_k, bit for bit.
    assert torch.equal(generalized_jsd_loss(student, teacher, mask, 0.5, top_k=V), whole)
    assert torch.equal(generalized_jsd_loss(student, teacher, mask, 0.5, top_k=V + 5), whole)


def test_beta_outside_0_1_is_refused():
    student, teacher, mask = _logits(0)
    with pytest.raises(ValueError, match="beta 1.5"):
        generalized_jsd_loss(student, teacher, mask, 1.5)
