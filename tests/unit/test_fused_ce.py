"""Fused chunked LM head + cross-entropy, summed (linear_cross_entropy_sum): equal to the
plain loss (value and gradients) on random tensors, in fp32 and under bf16 autocast, and
logits never materialized beyond one chunk."""

import math

import pytest
import torch
from fused_ce_helpers import (
    BF16_GRAD_RTOL,
    BF16_LOSS_RTOL,
    HEAD_TERMS,
    H,
    N,
    ShapeRecorder,
    V,
    assert_head_close,
    head_magnitudes,
    loss_and_grads,
    random_problem,
    reference_loss,
    relative_error,
)

from swiftlm.data.encode import IGNORE_INDEX
from swiftlm.losses import chunked_ce
from swiftlm.losses.chunked_ce import (
    ChunkedLinearCrossEntropy,
    default_chunk_size,
    linear_cross_entropy_sum,
)
from tolerance import assert_close


@pytest.mark.numerics
@pytest.mark.parametrize("chunk_size", [7, 10_000])
@pytest.mark.parametrize("bias", [False, True])
def test_function_matches_cross_entropy_fp32(chunk_size, bias):
    hidden, weight, b, targets = random_problem(bias=bias)
    tensors = [hidden, weight] + ([b] if bias else [])
    expected, expected_grads = loss_and_grads(
        lambda: reference_loss(hidden, weight, b, targets), tensors
    )
    got, grads = loss_and_grads(
        lambda: linear_cross_entropy_sum(hidden, weight, targets, b, chunk_size), tensors
    )
    assert got.dtype == torch.float32 and got.ndim == 0
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert grad.dtype == expected_grad.dtype
    sizes = head_magnitudes(hidden, weight, b, targets)
    assert_head_close(got, expected, sizes, grads=grads, expected_grads=expected_grads)


@pytest.mark.numerics
def test_ignored_rows_get_zero_hidden_gradient_and_backward_scales():
    hidden, weight, _, targets = random_problem(seed=1)
    loss = linear_cross_entropy_sum(hidden, weight, targets, chunk_size=7)
    (grad,) = torch.autograd.grad(loss * 0.25, [hidden])
    ignored = targets == IGNORE_INDEX
    assert ignored.any() and (~ignored).any()
    assert grad[ignored].abs().max() == 0
    (expected,) = torch.autograd.grad(reference_loss(hidden, weight, None, targets), [hidden])
    # A scale that backward ignored would be 4x off.
    sizes = head_magnitudes(hidden, weight, None, targets, scales=torch.full((N,), 0.25))
    assert_close(grad, 0.25 * expected, terms=HEAD_TERMS, magnitude=sizes["hidden"])


def test_all_targets_ignored_gives_zero_loss_and_zero_grads():
    hidden, weight, b, targets = random_problem(bias=True, ignored=1.0)
    assert (targets == IGNORE_INDEX).all()
    loss = linear_cross_entropy_sum(hidden, weight, targets, b, chunk_size=7)
    assert loss.requires_grad and float(loss.detach()) == 0.0
    grads = torch.autograd.grad(loss, [hidden, weight, b])
    assert [g.shape for g in grads] == [hidden.shape, weight.shape, b.shape]
    assert all(float(g.abs().max()) == 0.0 for g in grads)


def test_frozen_weight_gets_no_gradient():
    hidden, weight, _, targets = random_problem()
    weight.requires_grad_(False)
    loss = linear_cross_entropy_sum(hidden, weight, targets)
    loss.backward()
    assert weight.grad is None and hidden.grad is not None


@pytest.mark.numerics
def test_no_grad_computes_only_the_loss():
    hidden, weight, _, targets = random_problem()
    with torch.no_grad():
        loss = linear_cross_entropy_sum(hidden, weight, targets, chunk_size=7)
    assert not loss.requires_grad
    expected = reference_loss(hidden, weight, None, targets).detach()
    assert_head_close(loss, expected, head_magnitudes(hidden, weight, None, targets))


def test_second_backward_raises_instead_of_scaling_twice():
    hidden, weight, _, targets = random_problem()
    loss = ChunkedLinearCrossEntropy.apply(hidden, weight, None, targets, 7)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.numerics
@pytest.mark.parametrize("block_rows", [None, 5])
def test_under_bf16_autocast_within_bf16_tolerance(monkeypatch, block_rows):
    if block_rows:  # the weight gradient is accumulated in several blocks of vocab rows
        monkeypatch.setattr(chunked_ce, "_ACCUMULATE_BLOCK_ELEMENTS", block_rows * H)
    hidden, weight, b, targets = random_problem(bias=True)
    tensors = [hidden, weight, b]
    expected, expected_grads = loss_and_grads(
        lambda: reference_loss(hidden, weight, b, targets), tensors
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, grads = loss_and_grads(
            lambda: linear_cross_entropy_sum(hidden, weight, targets, b, chunk_size=7), tensors
        )
        plain = reference_loss(hidden, weight, b, targets)
    assert got.dtype == torch.float32
    # The logits really were computed in bf16: the fp32 result is not reproduced exactly...
    assert float(got) != float(expected)
    # ...but the plain head under the same autocast is (same bf16 logits, float32 softmax), up
    # to float32 rounding: far below the 0.1% that bf16 moves the loss.
    assert_head_close(got, plain, head_magnitudes(hidden, weight, b, targets))
    assert math.isclose(float(got), float(expected), rel_tol=BF16_LOSS_RTOL)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert grad.dtype == torch.float32  # the dtype of each input
        assert relative_error(grad, expected_grad) < BF16_GRAD_RTOL


def test_never_materializes_more_than_one_chunk_of_logits():
    hidden, weight, _, targets = random_problem(ignored=0.0)
    with ShapeRecorder() as recorder:
        loss = linear_cross_entropy_sum(hidden, weight, targets, chunk_size=7)
        loss.backward()
    # [H, V] is the transposed weight (a view), every other [rows, V] is logits.
    vocab_rows = [s[0] for s in recorder.shapes if len(s) == 2 and s[-1] == V and s != (H, V)]
    assert vocab_rows and max(vocab_rows) == 7
    # The recorder does see full logits when they exist.
    with ShapeRecorder() as recorder:
        reference_loss(hidden, weight, None, targets).backward()
    assert (N, V) in recorder.shapes


def test_default_chunk_keeps_float32_logits_near_64_mib():
    assert default_chunk_size(49152) == 341  # SmolLM2: 341 x 49152 x 4 B = 64 MiB
    assert default_chunk_size(400) == 41943
    assert default_chunk_size(2**22) == 64  # a floor, so huge vocabularies still batch rows
