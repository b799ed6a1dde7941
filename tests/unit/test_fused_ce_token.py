"""Fused chunked LM head + cross-entropy per token (linear_cross_entropy_per_token and
fused_causal_lm_loss(..., reduction="token")): equal to the plain token losses (value and
gradients of weighted sums) on random tensors and on a tiny Llama, and per-sequence sums
from one padded or packed micro-batch equal to running the samples one by one."""

import pytest
import torch
from fused_ce_helpers import (
    BF16_GRAD_RTOL,
    BF16_LOSS_RTOL,
    VOCAB,
    H,
    N,
    ScaledLogits,
    ShapeRecorder,
    V,
    assert_grads_close,
    assert_head_close,
    head_magnitudes,
    lora,
    packed_batch,
    padded_batch,
    random_problem,
    reference_loss,
    reference_token_losses,
    relative_error,
    tiny_llama,
    token_weights,
)

from swiftlm.data.collate import collate, collate_packed
from swiftlm.data.encode import IGNORE_INDEX
from swiftlm.losses import chunked_ce
from swiftlm.losses.causal_lm import (
    causal_lm_loss,
    count_sequences,
    sequence_ids_from_batch,
    sequence_sums,
    shifted_labels,
)
from swiftlm.losses.chunked_ce import linear_cross_entropy_per_token, linear_cross_entropy_sum
from swiftlm.losses.fused_ce import find_fused_lm_head, fused_causal_lm_loss, install_fused_lm_head
from tolerance import assert_close, backward_terms, forward_terms

# ---- the per-token function -----------------------------------------------------------------


def token_losses_and_grads(per_token_fn, tensors):
    """Token losses, and the gradients of sum(weights * token losses)."""
    losses = per_token_fn()
    weighted_sum = (losses * token_weights(losses.shape)).sum()
    return losses.detach(), torch.autograd.grad(weighted_sum, tensors)


@pytest.mark.numerics
@pytest.mark.parametrize("chunk_size", [1, 7, 10_000])
@pytest.mark.parametrize("bias", [False, True])
def test_per_token_matches_cross_entropy_none_fp32(chunk_size, bias):
    hidden, weight, b, targets = random_problem(bias=bias)
    # [5, 10] tokens: the result has the targets' shape, whatever it is.
    hidden, targets = hidden.detach().reshape(5, 10, H).requires_grad_(), targets.reshape(5, 10)
    tensors = [hidden, weight] + ([b] if bias else [])
    expected, expected_grads = token_losses_and_grads(
        lambda: reference_token_losses(hidden, weight, b, targets), tensors
    )
    got, grads = token_losses_and_grads(
        lambda: linear_cross_entropy_per_token(hidden, weight, targets, b, chunk_size), tensors
    )
    assert got.shape == targets.shape and got.dtype == torch.float32
    ignored = targets == IGNORE_INDEX
    assert ignored.any() and torch.equal(got[ignored], torch.zeros(int(ignored.sum())))
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert grad.dtype == expected_grad.dtype
    sizes = head_magnitudes(hidden, weight, b, targets, scales=token_weights(targets.shape))
    assert_head_close(got, expected, sizes, "token", grads, expected_grads)
    assert grads[0][ignored].abs().max() == 0  # ignored rows get no hidden gradient


@pytest.mark.numerics
def test_per_token_sums_to_the_fused_sum():
    hidden, weight, b, targets = random_problem(bias=True)
    token = linear_cross_entropy_per_token(hidden, weight, targets, b, chunk_size=7)
    total = linear_cross_entropy_sum(hidden, weight, targets, b, chunk_size=7)
    sizes = head_magnitudes(hidden, weight, b, targets)
    assert_head_close(token.detach().sum(), total.detach(), sizes)


def test_per_token_all_targets_ignored_gives_zeros_and_zero_grads():
    hidden, weight, b, targets = random_problem(bias=True, ignored=1.0)
    losses = linear_cross_entropy_per_token(hidden, weight, targets, b, chunk_size=7)
    assert losses.requires_grad and torch.equal(losses.detach(), torch.zeros(N))
    grads = torch.autograd.grad(losses.sum(), [hidden, weight, b])
    assert [g.shape for g in grads] == [hidden.shape, weight.shape, b.shape]
    assert all(float(g.abs().max()) == 0.0 for g in grads)


def test_per_token_frozen_weight_no_grad_and_retain_graph():
    hidden, weight, _, targets = random_problem()
    weight.requires_grad_(False)
    losses = linear_cross_entropy_per_token(hidden, weight, targets, chunk_size=7)
    # Nothing is precomputed in forward, so a second backward (retain_graph) is correct.
    losses.sum().backward(retain_graph=True)
    once = hidden.grad.clone()
    losses.sum().backward()
    assert weight.grad is None and torch.equal(hidden.grad, 2 * once)
    with torch.no_grad():
        no_grad = linear_cross_entropy_per_token(hidden, weight, targets, chunk_size=7)
    assert not no_grad.requires_grad and torch.equal(no_grad, losses.detach())


def test_per_token_mismatched_shapes_raise():
    hidden, weight, _, targets = random_problem()
    with pytest.raises(ValueError, match="do not match"):
        linear_cross_entropy_per_token(hidden, weight, targets[:-1])


@pytest.mark.numerics
@pytest.mark.parametrize("block_rows", [None, 5])
def test_per_token_under_bf16_autocast(monkeypatch, block_rows):
    """Forward under autocast, backward outside it (as a training loop does): backward must
    still run the head in bf16, as the summed loss (gradients made in forward) does."""
    if block_rows:
        monkeypatch.setattr(chunked_ce, "_ACCUMULATE_BLOCK_ELEMENTS", block_rows * H)
    hidden, weight, b, targets = random_problem(bias=True)
    tensors = [hidden, weight, b]
    expected = reference_token_losses(hidden, weight, b, targets).detach()
    expected_grads = torch.autograd.grad(reference_loss(hidden, weight, b, targets), tensors)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = linear_cross_entropy_per_token(hidden, weight, targets, b, chunk_size=7)
        plain = reference_token_losses(hidden, weight, b, targets).detach()
        fused_sum = linear_cross_entropy_sum(hidden, weight, targets, b, chunk_size=7)
    grads = torch.autograd.grad(losses.sum(), tensors)
    sum_grads = torch.autograd.grad(fused_sum, tensors)
    assert losses.dtype == torch.float32 and not torch.equal(losses.detach(), expected)
    # The same bf16 logits (and, in backward, the same bf16 matmuls as the summed loss's): equal
    # up to float32 rounding, far below the 0.3% that bf16 itself moves them.
    sizes = head_magnitudes(hidden, weight, b, targets)
    assert_head_close(losses.detach(), plain, sizes, "token", grads, sum_grads)
    assert relative_error(losses.detach(), expected) < BF16_LOSS_RTOL
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert grad.dtype == torch.float32
        assert relative_error(grad, expected_grad) < BF16_GRAD_RTOL


@pytest.mark.numerics
def test_per_token_with_bf16_parameters():
    hidden, weight, b, targets = random_problem(bias=True)
    low = [t.detach().to(torch.bfloat16).requires_grad_() for t in (hidden, weight, b)]
    losses = linear_cross_entropy_per_token(low[0], low[1], targets, low[2], chunk_size=7)
    plain = reference_token_losses(*low, targets)
    expected = reference_token_losses(hidden, weight, b, targets)
    assert losses.dtype == torch.float32
    sizes = head_magnitudes(*low, targets)  # the same bf16 logits: float32 rounding only
    assert_head_close(losses.detach(), plain.detach(), sizes, "token")
    assert relative_error(losses.detach(), expected.detach()) < BF16_LOSS_RTOL
    weights = token_weights((N,))
    grads = torch.autograd.grad((losses * weights).sum(), low)
    expected_grads = torch.autograd.grad((expected * weights).sum(), [hidden, weight, b])
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert grad.dtype == torch.bfloat16  # the dtype of each input
        assert relative_error(grad, expected_grad) < BF16_GRAD_RTOL


def test_per_token_never_materializes_more_than_one_chunk_of_logits():
    hidden, weight, _, targets = random_problem(ignored=0.0)
    with ShapeRecorder() as recorder:
        losses = linear_cross_entropy_per_token(hidden, weight, targets, chunk_size=7)
        (losses * token_weights((N,))).sum().backward()
    vocab_rows = [s[0] for s in recorder.shapes if len(s) == 2 and s[-1] == V and s != (H, V)]
    assert vocab_rows and max(vocab_rows) == 7


# ---- per-token and per-sequence losses through a tiny Llama -------------------------------


def token_losses_and_trainable_grads(model, loss_fn, batch):
    """Token losses of loss_fn(..., reduction="token"), and the trainable parameters'
    gradients of a weighted sum of them (per-token weights of both signs)."""
    model.zero_grad(set_to_none=True)
    losses, metrics = loss_fn(model, batch, reduction="token")
    assert metrics == {}
    (losses * token_weights(losses.shape)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses.detach(), grads


MODELS = {
    "full": tiny_llama,
    "tied": lambda: tiny_llama(tie=True),
    "lora": lambda: lora(tiny_llama()),
}


@pytest.mark.numerics
@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("make_batch", [padded_batch, packed_batch])
def test_fused_token_losses_match_plain_token_losses(model_name, make_batch):
    model, batch = MODELS[model_name](), make_batch()
    expected, expected_grads = token_losses_and_trainable_grads(model, causal_lm_loss, batch)
    assert install_fused_lm_head(model)
    head_outputs = []
    find_fused_lm_head(model).register_forward_hook(lambda m, a, out: head_outputs.append(out))
    got, grads = token_losses_and_trainable_grads(model, fused_causal_lm_loss, batch)
    labels = batch["labels"]
    assert [out.shape for out in head_outputs] == [labels.shape]  # losses, not logits
    # Not a view: FSDP2 warns that an in-place op on a module's view output skips its hooks.
    assert head_outputs[0]._base is None
    assert got.shape == labels.shape and got.dtype == torch.float32
    no_label = shifted_labels(labels) == IGNORE_INDEX
    assert (got[no_label] == 0).all() and (got[~no_label] > 0).all()
    tokens = labels.numel()  # the batch's positions: 3 x 12 padded, 1 x 12 packed
    assert_close(got, expected, terms=forward_terms(tokens), what="token losses")
    assert_grads_close(grads, expected_grads, backward_terms(tokens))
    summed = fused_causal_lm_loss(model, batch)[0].detach()
    assert_close(got.sum(), summed, terms=forward_terms(tokens), what="sum of token losses")


def test_unknown_reduction_raises():
    model = tiny_llama()
    for loss_fn in (causal_lm_loss, fused_causal_lm_loss):
        with pytest.raises(ValueError, match="reduction must be one of"):
            loss_fn(model, padded_batch(), reduction="mean")


@pytest.mark.numerics
def test_token_losses_through_a_casting_wrapper_and_a_transforming_model():
    model = tiny_llama()
    batch = padded_batch()
    expected = causal_lm_loss(model, batch, reduction="token")[0].detach()
    install_fused_lm_head(model)
    model.lm_head.register_forward_hook(lambda m, a, out: out.to(torch.bfloat16))
    got = fused_causal_lm_loss(model, batch, reduction="token")[0]
    assert got.dtype == torch.float32  # the float32 values, not the wrapper's bf16 copy
    terms = forward_terms(batch["labels"].numel())  # the bf16 copy would be off by ~0.4%
    assert_close(got.detach(), expected, terms=terms, what="token losses")
    assert not torch.equal(got.detach(), got.detach().to(torch.bfloat16).float())
    scaled = ScaledLogits()
    install_fused_lm_head(scaled)
    with pytest.raises(RuntimeError, match="changed the output of its lm_head"):
        fused_causal_lm_loss(scaled, padded_batch(), reduction="token")


def encoded_samples(lengths=(5, 9, 4, 7), seed=3):
    """Samples as the encoder makes them, the first two tokens of each a masked prompt."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        ids = torch.randint(1, VOCAB, (n,), generator=generator).tolist()
        samples.append({"input_ids": ids, "labels": [IGNORE_INDEX] * 2 + ids[2:]})
    return samples


@pytest.mark.numerics
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_sequence_sums_equal_sample_by_sample_losses(fused, packed):
    """What a DPO-style loss needs: each sample's summed log-likelihood from one padded or
    packed micro-batch, equal (value and gradient) to running the samples one by one."""
    model, samples = tiny_llama(), encoded_samples()
    loss_fn = fused_causal_lm_loss if fused else causal_lm_loss
    if fused:
        install_fused_lm_head(model)
    scales = token_weights((len(samples),))  # a weight per sample, of both signs
    expected = []
    for sample in samples:  # each alone, in a batch of one
        expected.append(loss_fn(model, collate([sample], pad_token_id=0))[0])
    # The samples' weights have both signs, so a gradient entry sums their gradients' entries
    # with cancellation: its magnitude is sum_s |scale_s| |grad_s|, not the sum's size.
    # (The plain loss gives those: the fused one backs its forward only once.)
    sizes = [0.0] * len(list(model.parameters()))
    for sample, scale in zip(samples, scales, strict=True):
        loss = causal_lm_loss(model, collate([sample], pad_token_id=0))[0]
        one = torch.autograd.grad(loss * scale, list(model.parameters()))
        sizes = [size + g.abs() for size, g in zip(sizes, one, strict=True)]
    expected_grads = torch.autograd.grad((torch.stack(expected) * scales).sum(), model.parameters())

    rows = [samples[:2], samples[2:]]  # two samples per row, the second row padded
    batch = collate_packed(rows, pad_token_id=0) if packed else collate(samples, pad_token_id=0)
    token_losses = loss_fn(model, batch, reduction="token")[0]
    ids = sequence_ids_from_batch(batch)
    sums = sequence_sums(token_losses, ids, count_sequences(ids))
    grads = torch.autograd.grad((sums * scales).sum(), model.parameters())
    assert sums.shape == (len(samples),)
    tokens = batch["labels"].numel()  # the batch's positions, more than any sample alone has
    want = torch.stack(expected).detach()
    assert_close(sums.detach(), want, terms=forward_terms(tokens), what="sequence sums")
    for size, grad, expected_grad in zip(sizes, grads, expected_grads, strict=True):
        magnitude = float(size.max())
        assert_close(grad, expected_grad, terms=backward_terms(tokens), magnitude=magnitude)
