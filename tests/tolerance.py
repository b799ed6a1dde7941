"""Tolerances of the numerical parity tests, derived once from the arithmetic.

A parity test runs one computation two ways that are equal in exact arithmetic: two ranks and
one process, four micro-batches and one batch of four, a pipeline and a single stage, the loss
and its formula, one machine's kernels and another's (AVX2, AVX-512, AMX and GPUs block their
sums differently). In floating point the two differ only by how their sums are ordered, so their
difference is bounded by the rounding of those sums, and by nothing the test's own machine
happened to give.

The bound. A sum of n terms in a format with unit roundoff u (half the dtype's epsilon) is off
by at most gamma_n * S, S = sum of the terms' magnitudes (Higham, *Accuracy and Stability of
Numerical Algorithms*, section 4.2). That worst case assumes every rounding goes the same way;
rounding errors behave as independent and mean-zero, and then with probability at least
1 - 2n exp(-lambda^2 (1 - u)^2 / 2) the error stays below about lambda * sqrt(n) * u * S (Higham
and Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41,
2019). With lambda = 6 a false failure has a chance below 3e-8 n per compared value (4e-5 for
the tiny Llama's 1,400 terms); two evaluations can each be off by that much, so they differ by
at most
2 * lambda * sqrt(n) * u * S = lambda * sqrt(n) * eps * S.

`terms` is the length of the longest chain of summations that feeds the value (a network's
value carries the roundings of every layer it went through: `forward_terms` counts them for the
tiny test Llama). Every bug these tests exist for (a normalizer over the wrong tokens, a dropped
micro-batch, a missing all-reduce, a wrong position id) moves the values by a fraction of the
values themselves, percent-sized, orders of magnitude above these bounds.

Where the arithmetic of two runs is the same (a resumed run against an uninterrupted one on the
same machine and shapes) the tests assert exact equality instead: there rounding cannot differ.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

# A false failure with probability below 2 n exp(-lambda^2 / 2) = 3e-8 n per compared value.
LAMBDA = 6.0

# Adam (and AdamW) moves a weight by lr * m_hat / (sqrt(v_hat) + eps) per step, at most about lr
# (exactly lr on the first step). Rounding enters through the ratio m_hat / sqrt(v_hat) of two
# statistics of the same gradient element, whose relative rounding is the gradient's: a few
# 1e-5 for the tiny Llama (`rounding_bound(1, backward_terms(...))`). For an element whose
# gradient nearly cancels (large terms summing to almost zero) eps bounds nothing: a tiny change
# of a tiny gradient can turn a full lr-sized step, so the largest single difference has no
# bound below Adam's own 2 * lr * steps. The root mean square of a tensor's differences has
# one: the well-conditioned elements keep it near the gradient's rounding, the few
# near-cancelling ones are averaged in. We allow an RMS of 1e-3 of the largest move Adam can
# make, 30x the rounding of a well-conditioned element. A real bug (a missed all-reduce, a wrong
# normalizer, a skipped step, one layer left unsynchronised) changes whole updates of a tensor,
# >= 10% of lr per step.
ADAM_RELATIVE = 1e-3


def eps(dtype: torch.dtype = torch.float32) -> float:
    """The dtype's machine epsilon (float32 1.19e-7, bfloat16 7.8e-3, float16 9.8e-4)."""
    return torch.finfo(dtype).eps


def rounding_bound(magnitude: float, terms: int, dtype: torch.dtype = torch.float32) -> float:
    """The most two evaluations of a value may differ when they order its sums differently:
    lambda * sqrt(terms) * eps * magnitude (see the module docstring), `magnitude` being the sum
    of the magnitudes of what was added (for a mean of same-signed terms: the value itself)."""
    if terms < 1:
        raise ValueError(f"terms must be at least 1, got {terms}")
    return LAMBDA * math.sqrt(terms) * eps(dtype) * abs(magnitude)


def forward_terms(
    tokens: int,
    *,
    hidden: int = 64,
    intermediate: int = 128,
    layers: int = 2,
    head_dim: int = 16,
    vocab: int = 400,
) -> int:
    """The longest chain of summations behind a loss over `tokens` tokens of a Llama (defaults:
    the tiny test Llama of conftest.make_tiny_llama). Per layer: the RMSNorm, the q/k/v
    projections (hidden), the scores (head_dim), the attention-weighted sum (up to `tokens`
    positions), the output projection (hidden), the second RMSNorm, the gate/up projections
    (hidden) and the down projection (intermediate); then the final norm and head (hidden), the
    log-softmax (vocab) and the sum over tokens. A backward pass runs the same chain once more
    and sums each weight's gradient over the tokens: twice the forward covers it."""
    per_layer = hidden + hidden + head_dim + tokens + hidden + hidden + hidden + intermediate
    return layers * per_layer + hidden + hidden + vocab + tokens


def backward_terms(tokens: int, **model) -> int:
    """The chain behind a gradient (and so a grad norm): the forward's, twice (see above)."""
    return 2 * forward_terms(tokens, **model)


def _as_list(values) -> list[float]:
    if isinstance(values, torch.Tensor):
        return values.detach().double().flatten().tolist()
    if isinstance(values, (int, float)):
        return [float(values)]
    return [float(v) for v in values]


def assert_close(
    actual,
    expected,
    *,
    terms: int,
    magnitude: float | None = None,
    dtype: torch.dtype = torch.float32,
    what: str = "value",
) -> None:
    """Assert `actual` equals `expected` (numbers, lists or tensors) up to the rounding of
    `terms` summed terms in `dtype`. `magnitude` is the sum of the magnitudes of what was added
    per value; by default each value's own size (right for sums and means of same-signed terms,
    such as log-probs and cross-entropies)."""
    got, want = _as_list(actual), _as_list(expected)
    assert len(got) == len(want), f"{what}: {len(got)} values against {len(want)}"
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        size = magnitude if magnitude is not None else max(abs(a), abs(b))
        bound = rounding_bound(size, terms, dtype)
        assert math.isfinite(a) and abs(a - b) <= bound, (
            f"{what}[{index}]: {a!r} against {b!r}, difference {abs(a - b):.3g} above the "
            f"rounding bound {bound:.3g} ({terms} terms in {dtype}, magnitude {size:.3g})"
        )


def assert_trained_weights_close(
    weights_a: Path | dict, weights_b: Path | dict, *, learning_rate: float, steps: int
) -> None:
    """Assert two sets of weights (safetensors files or name -> tensor dicts) trained with Adam
    from the same start, by arithmetic equal in exact numbers, agree: each tensor's
    root-mean-square difference within ADAM_RELATIVE of the largest move Adam can make in
    `steps` steps of `learning_rate`."""
    a, b = _tensors(weights_a), _tensors(weights_b)
    assert a.keys() == b.keys(), f"{weights_a} and {weights_b} hold different tensors"
    bound = ADAM_RELATIVE * learning_rate * steps
    rms, key = max((_rms_difference(a[key], b[key]), key) for key in a)
    assert rms <= bound, (
        f"trained weights {key} differ by {rms:.3g} (root mean square), above {bound:.3g} "
        f"({ADAM_RELATIVE} of lr {learning_rate} x {steps} steps)"
    )


def assert_same_weights(weights_a: Path | dict, weights_b: Path | dict) -> None:
    """Assert two sets of weights (safetensors files or dicts) hold bit-identical tensors (the
    same arithmetic: no rounding can differ, so no tolerance)."""
    a, b = _tensors(weights_a), _tensors(weights_b)
    assert a.keys() == b.keys(), f"{weights_a} and {weights_b} hold different tensors"
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[0]}"


def _tensors(weights: Path | dict) -> dict:
    if isinstance(weights, dict):
        return weights
    from safetensors.torch import load_file

    return load_file(weights)


def _rms_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).pow(2).mean().sqrt().item()


def assert_same_training(
    reference: Path,
    run: Path,
    weights: str,
    *,
    learning_rate: float,
    steps: int,
    tokens: int,
    ranks: int = 1,
) -> None:
    """Assert that training run `run` (parallel, accumulated, ...) did what `reference` did:
    the same logged losses and grad norms up to their rounding (a mean cross-entropy over
    sequences of at most `tokens` tokens, summed over `ranks` ranks), and final weights
    `final/<weights>` within Adam's bound."""
    from conftest import logged

    terms = forward_terms(tokens) + ranks
    assert_close(logged(run), logged(reference), terms=terms, what=f"{run.name} loss")
    norms = logged(reference, "grad_norm")
    terms = backward_terms(tokens) + ranks
    assert_close(logged(run, "grad_norm"), norms, terms=terms, what=f"{run.name} grad_norm")
    assert_trained_weights_close(
        reference / "final" / weights,
        run / "final" / weights,
        learning_rate=learning_rate,
        steps=steps,
    )
