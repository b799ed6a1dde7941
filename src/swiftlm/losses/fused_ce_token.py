"""Per-token fused LM head + cross-entropy: one loss per target, logits never materialized.

The companion of `fused_ce.linear_cross_entropy_sum` for methods that need the token losses
themselves: per-sequence sums for DPO-style preference losses, per-sample weights for SFT.
A summed loss can compute its gradients in forward, because backward only scales them by one
number. Per-token losses get one grad_output per token, known only in backward, so here
forward computes the losses chunk by chunk and keeps each row's logsumexp (4 bytes a row),
and backward recomputes each chunk's logits to form (softmax - onehot) * grad_output[rows]
and push it through the head's matmul. One chunk of logits stays the largest vocab-sized
temporary in forward and in backward; the price is a second head matmul per chunk. Between
forward and backward only the inputs (as nn.Linear keeps them) and the small per-row tensors
are held, so unlike the summed loss a second backward (retain_graph) works.
"""

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from swiftlm.data.encode import IGNORE_INDEX
from swiftlm.losses.fused_ce import (
    _float32_zeros,
    autocast_off,
    compute_dtype_for,
    default_chunk_size,
    push_through_head,
)


def _token_losses(hidden, weight, bias, targets, chunk_size, compute_dtype):
    """Losses shaped like targets in float32 (0 where the target is ignored), the rows of
    hidden `[N, H]` with a target, their targets and their logsumexp: what backward needs to
    rebuild the softmax of any chunk."""
    flat_targets = targets.reshape(-1)
    rows = (flat_targets != IGNORE_INDEX).nonzero().squeeze(1)
    row_targets = flat_targets.index_select(0, rows)
    # Filled through a flat view but returned whole: a view as the head's output would make
    # FSDP2 warn that an in-place op on it could skip its pre-backward all-gather.
    losses = _float32_zeros(targets.shape, hidden.device)
    flat_losses = losses.view(-1)
    logsumexp = _float32_zeros(rows.shape, hidden.device)
    with autocast_off(hidden.device.type):
        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        for start in range(0, rows.numel(), chunk_size):
            chunk = slice(start, start + chunk_size)
            lse, loss = _chunk_losses(hidden, rows[chunk], row_targets[chunk], w, b)
            logsumexp[chunk] = lse
            flat_losses.index_copy_(0, rows[chunk], loss)
    return losses, rows, row_targets, logsumexp


def _chunk_logits(hidden, chunk_rows, w, b):
    """One chunk's hidden rows in the compute dtype (w's) and its logits in float32."""
    h = hidden.index_select(0, chunk_rows).to(w.dtype)
    return h, F.linear(h, w, b).float()


def _chunk_losses(hidden, chunk_rows, chunk_targets, w, b):
    """(logsumexp, loss) of each row of one chunk; a function of its own so that one chunk's
    logits are freed before the next chunk's exist."""
    _, logits = _chunk_logits(hidden, chunk_rows, w, b)
    target_logits = logits.gather(1, chunk_targets.unsqueeze(1)).squeeze(1)
    # The formula of the summed loss, with exp() in place over the logits (see fused_ce).
    row_max = logits.amax(dim=1)
    lse = row_max + logits.sub_(row_max.unsqueeze(1)).exp_().sum(dim=1).log()
    return lse, lse - target_logits


def _token_grads(ctx, grad_output, wants):
    """The gradients named in `wants` (hidden, weight, bias), recomputed chunk by chunk."""
    hidden, weight, bias, rows, row_targets, logsumexp = ctx.saved_tensors
    want_hidden, want_weight, want_bias = wants
    grad_hidden = torch.zeros_like(hidden) if want_hidden else None
    grad_weight = _float32_zeros(weight.shape, weight.device) if want_weight else None
    grad_bias = _float32_zeros(weight.shape[:1], weight.device) if want_bias else None
    grads = (grad_hidden, grad_weight, grad_bias)
    row_scales = grad_output.reshape(-1).index_select(0, rows).float()
    with autocast_off(hidden.device.type):
        w = weight.to(ctx.compute_dtype)
        b = bias.to(ctx.compute_dtype) if bias is not None else None
        for start in range(0, rows.numel(), ctx.chunk_size):
            chunk = slice(start, start + ctx.chunk_size)
            scaled = (row_targets[chunk], logsumexp[chunk], row_scales[chunk])
            _chunk_grads(hidden, rows[chunk], scaled, w, b, grads)
    grad_weight = grad_weight.to(weight.dtype) if want_weight else None
    grad_bias = grad_bias.to(bias.dtype) if want_bias else None
    return grad_hidden, grad_weight, grad_bias


def _chunk_grads(hidden, chunk_rows, scaled, w, b, grads) -> None:
    """Adds one chunk's gradients to the accumulators in grads that are not None; `scaled`
    holds the chunk's targets, logsumexp and grad_output."""
    chunk_targets, lse, scale = scaled
    h, logits = _chunk_logits(hidden, chunk_rows, w, b)
    # d loss_i / d logits_i = softmax_i - onehot_i, times grad_output_i, in the logits' memory.
    grad_logits = logits.sub_(lse.unsqueeze(1)).exp_()
    grad_logits[torch.arange(chunk_targets.numel(), device=lse.device), chunk_targets] -= 1.0
    grad_logits.mul_(scale.unsqueeze(1))
    push_through_head(grad_logits, chunk_rows, h, w, grads)


class ChunkedLinearCrossEntropyPerToken(torch.autograd.Function):
    """cross_entropy(hidden[i] @ weight.T + bias, targets[i]) for every row i, 0 where
    targets[i] == -100.

    hidden `[N, H]`, weight `[V, H]`, bias `[V]` or None, targets of N elements in any shape
    (already shifted), chunk_size rows or None for `default_chunk_size(V)`. Returns float32
    losses shaped like targets. Matmuls run
    in the compute dtype (autocast's if on in forward, else the weight's), softmax and the
    weight/bias gradient sums in float32, as in `ChunkedLinearCrossEntropy`.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size=None):
        ctx.chunk_size = chunk_size or default_chunk_size(weight.shape[0])
        # Read here: backward runs without the caller's autocast state.
        ctx.compute_dtype = compute_dtype_for(hidden.device.type, weight.dtype)
        losses, *per_row = _token_losses(
            hidden, weight, bias, targets, ctx.chunk_size, ctx.compute_dtype
        )
        ctx.save_for_backward(hidden, weight, bias, *per_row)
        return losses

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        wants = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            ctx.needs_input_grad[2],  # False when bias is None
        )
        return (*_token_grads(ctx, grad_output, wants), None, None)


def linear_cross_entropy_per_token(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Fused head + per-token cross-entropy for hidden `[..., H]` and targets `[...]`
    (shifted, -100 = ignore): float32 losses shaped like targets, 0 at ignored positions.
    Their sum equals `linear_cross_entropy_sum` up to float32 rounding. Without autograd
    (no_grad, or nothing requires grad) nothing is kept for backward."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden states {tuple(hidden.shape)} do not match targets {tuple(targets.shape)}"
        )
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.to(hidden.device)
    inputs = [hidden, weight] + ([bias] if bias is not None else [])
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        return ChunkedLinearCrossEntropyPerToken.apply(
            flat_hidden, weight, bias, targets, chunk_size
        )
    chunk_size = chunk_size or default_chunk_size(weight.shape[0])
    compute_dtype = compute_dtype_for(hidden.device.type, weight.dtype)
    losses, *_ = _token_losses(flat_hidden, weight, bias, targets, chunk_size, compute_dtype)
    return losses
