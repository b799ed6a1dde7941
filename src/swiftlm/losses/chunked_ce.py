"""Chunked linear cross-entropy: an LM head's matmul and its loss without the logits.

The plain loss materializes the logits `[tokens, vocab]`, a float32 copy of them, and the
same again for their gradient in backward. For SmolLM2 (vocab 49152) a batch of 4 x 512
tokens makes each float32 copy 400 MB, more than the model itself. Here the head is computed
only for the rows that carry a label, one chunk of rows at a time (<= 64 MiB of float32
logits by default), the idea of Liger-kernel's fused linear cross-entropy. Both reductions
share the chunking, the compute dtype and the push of d loss / d logits through the head;
they differ in when the gradients are formed, because of what backward is given:

* summed (`linear_cross_entropy_sum`, `ChunkedLinearCrossEntropy`): backward only scales the
  gradients by one number, so each chunk's gradients (softmax - onehot, pushed through the
  head) are computed in forward, in the same pass as its loss, and nothing is recomputed.
  Held from forward to backward: a gradient the size of the hidden states and, only when
  the head is trained, one the size of the head weight.
* per token (`linear_cross_entropy_per_token`, `ChunkedLinearCrossEntropyPerToken`), for
  methods that need the token losses themselves (per-sequence sums for DPO-style preference
  losses, per-sample weights for SFT): each token gets its own grad_output, known only in
  backward, so forward keeps each row's logsumexp (4 bytes a row) and backward recomputes
  each chunk's logits to form (softmax - onehot) * grad_output[rows]. The price is a second
  head matmul per chunk; only the inputs and small per-row tensors are held, so unlike the
  summed loss a second backward (retain_graph) works.

In both, one chunk of logits is the largest vocab-sized temporary. `fused_ce` puts these
functions in a model's head.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from swiftlm.data.encode import IGNORE_INDEX

# One chunk's float32 logits stay at or below 2**24 elements (64 MiB).
_CHUNK_ELEMENTS = 2**24
_MIN_CHUNK_ROWS = 64
# Rows of the weight gradient accumulated at once from a low-precision product (16 MiB).
_ACCUMULATE_BLOCK_ELEMENTS = 2**22


# ---- shared by both reductions ---------------------------------------------------------------


def default_chunk_size(vocab_size: int) -> int:
    """Rows per chunk so that one chunk of float32 logits is about 64 MiB at most."""
    return max(_MIN_CHUNK_ROWS, _CHUNK_ELEMENTS // vocab_size)


def compute_dtype_for(device_type: str, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the plain head would run its matmul in: autocast's if it is on."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight_dtype


def autocast_off(device_type: str):
    """A context with autocast disabled: the fused losses apply the compute dtype by explicit
    casts, and their float32 softmax/gradient math must not be cast down again."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _in_compute_dtype(weight, bias, compute_dtype):
    """The head's weight and bias cast once, not per chunk (a copy the size of the weight)."""
    return weight.to(compute_dtype), bias.to(compute_dtype) if bias is not None else None


def _float32_zeros(shape, device) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float32, device=device)


def _gradient_accumulators(hidden, weight, wants) -> tuple:
    """Zeroed (hidden, weight, bias) gradients for those named in `wants`, None for the rest.
    The weight and bias ones are float32 because they sum over all chunks."""
    want_hidden, want_weight, want_bias = wants
    return (
        torch.zeros_like(hidden) if want_hidden else None,
        _float32_zeros(weight.shape, weight.device) if want_weight else None,
        _float32_zeros(weight.shape[:1], weight.device) if want_bias else None,
    )


def _in_parameter_dtypes(grads, weight, bias) -> tuple:
    """The accumulated gradients with the weight's and bias's own dtypes, as autograd wants."""
    grad_hidden, grad_weight, grad_bias = grads
    grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
    grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
    return grad_hidden, grad_weight, grad_bias


def push_through_head(grad_logits, chunk_rows, h, w, grads) -> None:
    """Add a chunk's gradients of the head's inputs (hidden rows, weight, bias) to the
    accumulators in grads that are not None, from d loss / d logits of its rows."""
    grad_hidden, grad_weight, grad_bias = grads
    if grad_bias is not None:
        grad_bias += grad_logits.sum(0)
    g = grad_logits.to(w.dtype)
    if grad_hidden is not None:
        grad_hidden.index_copy_(0, chunk_rows, (g @ w).to(grad_hidden.dtype))
    if grad_weight is not None:
        _accumulate(grad_weight, g.t(), h)


def _accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b, where total `[V, H]` is float32 and a, b may be low precision."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)  # in place: no weight-sized temporary
        return
    # A low-precision product is added in blocks of rows, so that it and its float32 upcast
    # are block-sized temporaries rather than two more copies of the weight.
    block_rows = max(1, _ACCUMULATE_BLOCK_ELEMENTS // total.shape[1])
    for start in range(0, total.shape[0], block_rows):
        total[start : start + block_rows] += a[start : start + block_rows] @ b


def _check_shapes(hidden: torch.Tensor, targets: torch.Tensor) -> None:
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden states {tuple(hidden.shape)} do not match targets {tuple(targets.shape)}"
        )


def _needs_autograd(hidden, weight, bias) -> bool:
    """Whether backward can reach the inputs. Inside a Function's forward needs_input_grad
    ignores no_grad mode, so the loss-only case (evaluation) is told apart here, before it."""
    inputs = [hidden, weight] + ([bias] if bias is not None else [])
    return torch.is_grad_enabled() and any(x.requires_grad for x in inputs)


# ---- summed: the gradients computed in forward -----------------------------------------------


def _loss_and_grads(hidden, weight, bias, targets, chunk_size, wants):
    """Loss sum over rows with a target, and the gradients named in `wants`
    (hidden, weight, bias), each of them computed chunk by chunk in one pass.

    Every matmul runs in the compute dtype, like the plain head under autocast; softmax and
    the loss run in float32, and the weight/bias gradients accumulate in float32 because they
    sum over all chunks.
    """
    device_type = hidden.device.type
    compute_dtype = compute_dtype_for(device_type, weight.dtype)  # before autocast goes off
    chunk_size = chunk_size or default_chunk_size(weight.shape[0])
    with autocast_off(device_type):
        return _chunked_loss_and_grads(
            hidden, weight, bias, targets, chunk_size, compute_dtype, wants
        )


def _chunked_loss_and_grads(hidden, weight, bias, targets, chunk_size, compute_dtype, wants):
    w, b = _in_compute_dtype(weight, bias, compute_dtype)
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grads = _gradient_accumulators(hidden, weight, wants)
    for start in range(0, rows.numel(), chunk_size):
        loss += _chunk_loss(hidden, targets, rows[start : start + chunk_size], w, b, grads)
    return loss, *_in_parameter_dtypes(grads, weight, bias)


def _chunk_loss(hidden, targets, chunk_rows, w, b, grads) -> torch.Tensor:
    """Loss sum of one chunk of rows, with w and b already in the compute dtype; adds the
    chunk's gradients to the accumulators in grads (hidden, weight, bias) that are not None.
    A function of its own so that one chunk's logits are freed before the next chunk's
    exist: the peak is one chunk, not two."""
    h = hidden.index_select(0, chunk_rows).to(w.dtype)
    t = targets.index_select(0, chunk_rows).unsqueeze(1)
    logits = F.linear(h, w, b).float()
    target_logits = logits.gather(1, t)
    # logsumexp by hand, so that exp() runs in place over the logits: torch.logsumexp
    # would allocate another chunk-sized temporary.
    row_max = logits.amax(dim=1, keepdim=True)
    exp_logits = logits.sub_(row_max).exp_()
    sum_exp = exp_logits.sum(dim=1, keepdim=True)
    loss = (row_max + sum_exp.log() - target_logits).sum()
    if all(g is None for g in grads):
        return loss
    # d loss / d logits = softmax - onehot, still in the logits' memory.
    grad_logits = exp_logits.div_(sum_exp)
    grad_logits[torch.arange(t.shape[0], device=t.device), t.squeeze(1)] -= 1.0
    push_through_head(grad_logits, chunk_rows, h, w, grads)
    return loss


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over rows with targets[i] != -100 of cross_entropy(hidden[i] @ weight.T + bias, targets[i]).

    hidden `[N, H]`, weight `[V, H]`, bias `[V]` or None, targets `[N]` (already shifted),
    chunk_size rows or None for `default_chunk_size(V)`. Returns a 0-d float32 tensor.
    The gradients are computed in forward (see the module docstring) and handed over by
    backward, so backward runs at most once per forward: a second one (retain_graph) raises.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size=None):
        wants = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2],
        )
        loss, grad_hidden, grad_weight, grad_bias = _loss_and_grads(
            hidden, weight, bias, targets, chunk_size, wants
        )
        # An attribute, not save_for_backward: backward can then drop the only other
        # reference, and autograd moves the weight gradient into .grad instead of copying it.
        ctx.precomputed_grads = [grad_hidden, grad_weight, grad_bias]
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grads, ctx.precomputed_grads = ctx.precomputed_grads, None
        if grads is None:
            raise RuntimeError(
                "ChunkedLinearCrossEntropy: backward ran twice on one forward (retain_graph); "
                "its gradients were computed in forward and already handed over"
            )
        # In place: a scaled copy of a weight-sized gradient would cost what fusing saved.
        grad_hidden, grad_weight, grad_bias = (
            g.mul_(grad_output) if g is not None else None for g in grads
        )
        del grads
        return grad_hidden, grad_weight, grad_bias, None, None


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Fused head + cross-entropy sum for hidden `[..., H]` and targets `[...]` (shifted,
    -100 = ignore). Without autograd (no_grad, or nothing requires grad) only the loss is
    computed."""
    _check_shapes(hidden, targets)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    if _needs_autograd(hidden, weight, bias):
        return ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_size)
    return _loss_and_grads(hidden, weight, bias, targets, chunk_size, (False,) * 3)[0]


# ---- per token: the gradients recomputed in backward -----------------------------------------


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
        w, b = _in_compute_dtype(weight, bias, compute_dtype)
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
    # The formula of the summed loss (`_chunk_loss`), with exp() in place over the logits.
    row_max = logits.amax(dim=1)
    lse = row_max + logits.sub_(row_max.unsqueeze(1)).exp_().sum(dim=1).log()
    return lse, lse - target_logits


def _token_grads(ctx, grad_output, wants):
    """The gradients named in `wants` (hidden, weight, bias), recomputed chunk by chunk."""
    hidden, weight, bias, rows, row_targets, logsumexp = ctx.saved_tensors
    grads = _gradient_accumulators(hidden, weight, wants)
    row_scales = grad_output.reshape(-1).index_select(0, rows).float()
    with autocast_off(hidden.device.type):
        w, b = _in_compute_dtype(weight, bias, ctx.compute_dtype)
        for start in range(0, rows.numel(), ctx.chunk_size):
            chunk = slice(start, start + ctx.chunk_size)
            scaled = (row_targets[chunk], logsumexp[chunk], row_scales[chunk])
            _chunk_grads(hidden, rows[chunk], scaled, w, b, grads)
    return _in_parameter_dtypes(grads, weight, bias)


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
    losses shaped like targets. Matmuls run in the compute dtype (autocast's if on in
    forward, else the weight's), softmax and the weight/bias gradient sums in float32, as in
    `ChunkedLinearCrossEntropy`.
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
    _check_shapes(hidden, targets)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.to(hidden.device)
    if _needs_autograd(hidden, weight, bias):
        return ChunkedLinearCrossEntropyPerToken.apply(
            flat_hidden, weight, bias, targets, chunk_size
        )
    chunk_size = chunk_size or default_chunk_size(weight.shape[0])
    compute_dtype = compute_dtype_for(hidden.device.type, weight.dtype)
    losses, *_ = _token_losses(flat_hidden, weight, bias, targets, chunk_size, compute_dtype)
    return losses
