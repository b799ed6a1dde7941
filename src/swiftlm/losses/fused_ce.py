"""Fused, chunked LM head + cross-entropy: a causal LM's loss without its logits.

The plain loss materializes the logits `[tokens, vocab]`, a float32 copy of them, and the
same again for their gradient in backward. For SmolLM2 (vocab 49152) a batch of 4 x 512
tokens makes each float32 copy 400 MB, more than the model itself. Here the head is computed
only for the rows that carry a label, one chunk of rows at a time, and in the same pass each
chunk's gradients are computed too (softmax - onehot, pushed through the head's matmul), the
idea of Liger-kernel's fused linear cross-entropy. Backward then only scales the stored
gradients by grad_output: nothing is recomputed, and the logits of one chunk (<= 64 MiB in
float32 by default) are the largest vocab-sized temporary. What is held from forward to
backward is a gradient the size of the hidden states and, only when the head is trained, one
the size of the head weight.

Wiring it into a model, through whatever wraps it (peft, DDP, FSDP2, DeepSpeed):

* `install_fused_lm_head(model)` gives the model's `lm_head` Linear an instance-level
  `forward` that returns the loss sum instead of logits while targets are pending on it, and
  the plain logits otherwise (generation and evaluation are unchanged). Parameter names,
  the state dict and the module hooks of FSDP2 / DeepSpeed ZeRO-3 (which gather the weight
  before forward) stay exactly as they were.
* `fused_causal_lm_loss(model, batch)` puts the shifted labels on that head, calls the
  (wrapped) model's normal forward, so every wrapper runs its hooks and DDP its gradient
  sync, and returns the loss sum that came out as `outputs.logits`. With reduction="token"
  the head returns the per-token losses instead (`fused_ce_token`, which recomputes each
  chunk's logits in backward because its gradient depends on a per-token grad_output).
"""

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn

from swiftlm.data.collate import model_inputs
from swiftlm.data.encode import IGNORE_INDEX
from swiftlm.losses.causal_lm import causal_lm_loss, check_reduction, shifted_labels

# Attributes set on the head module instance. Plain (non-Parameter) attributes never reach
# the state dict.
_MARKER = "_swiftlm_fused_ce"
_PENDING = "_swiftlm_pending"  # (shifted targets, reduction) for the next head call
_FUSED_LOSS = "_swiftlm_fused_loss"

# One chunk's float32 logits stay at or below 2**24 elements (64 MiB).
_CHUNK_ELEMENTS = 2**24
_MIN_CHUNK_ROWS = 64
# Rows of the weight gradient accumulated at once from a low-precision product (16 MiB).
_ACCUMULATE_BLOCK_ELEMENTS = 2**22

# Config fields of models that change the logits after the lm_head (Gemma 2/3 soft-capping,
# Cohere's logit_scale, Granite's logits_scaling), with the values that leave them unchanged.
# The fused head returns a loss, not logits, so these models keep the plain loss.
_LOGIT_TRANSFORMS = {
    "final_logit_softcapping": (None,),
    "logit_softcapping": (None,),
    "logits_soft_cap": (None,),
    "logit_scale": (None, 1, 1.0),
    "logits_scaling": (None, 1, 1.0),
}


# ---- the fused function ---------------------------------------------------------------------


def default_chunk_size(vocab_size: int) -> int:
    """Rows per chunk so that one chunk of float32 logits is about 64 MiB at most."""
    return max(_MIN_CHUNK_ROWS, _CHUNK_ELEMENTS // vocab_size)


def compute_dtype_for(device_type: str, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the plain head would run its matmul in: autocast's if it is on."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight_dtype


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


def autocast_off(device_type: str):
    """A context with autocast disabled: the fused losses apply the compute dtype by explicit
    casts, and their float32 softmax/gradient math must not be cast down again."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _chunked_loss_and_grads(hidden, weight, bias, targets, chunk_size, compute_dtype, wants):
    want_hidden, want_weight, want_bias = wants
    w = weight.to(compute_dtype)  # once, not per chunk (a copy the size of the weight)
    b = bias.to(compute_dtype) if bias is not None else None
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)

    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.zeros_like(hidden) if want_hidden else None
    grad_weight = _float32_zeros(weight.shape, weight.device) if want_weight else None
    grad_bias = _float32_zeros(weight.shape[:1], weight.device) if want_bias else None

    grads = (grad_hidden, grad_weight, grad_bias)
    for start in range(0, rows.numel(), chunk_size):
        loss += _chunk_loss(hidden, targets, rows[start : start + chunk_size], w, b, grads)

    grad_weight = grad_weight.to(weight.dtype) if want_weight else None
    grad_bias = grad_bias.to(bias.dtype) if want_bias else None
    return loss, grad_hidden, grad_weight, grad_bias


def _float32_zeros(shape, device) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float32, device=device)


def _chunk_loss(hidden, targets, chunk_rows, w, b, grads) -> torch.Tensor:
    """Loss sum of one chunk of rows, with w and b already in the compute dtype; adds the
    chunk's gradients to the accumulators in grads (hidden, weight, bias) that are not None.
    A function of its own so that one chunk's logits are freed before the next chunk's
    exist: the peak is one chunk, not two."""
    grad_hidden, grad_weight, grad_bias = grads
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
    if grad_hidden is None and grad_weight is None and grad_bias is None:
        return loss
    # d loss / d logits = softmax - onehot, still in the logits' memory.
    grad_logits = exp_logits.div_(sum_exp)
    grad_logits[torch.arange(t.shape[0], device=t.device), t.squeeze(1)] -= 1.0
    push_through_head(grad_logits, chunk_rows, h, w, grads)
    return loss


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
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden states {tuple(hidden.shape)} do not match targets {tuple(targets.shape)}"
        )
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    inputs = [hidden, weight] + ([bias] if bias is not None else [])
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        return ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_size)
    # Inside a Function's forward needs_input_grad ignores no_grad mode, so the loss-only
    # case (evaluation) is sent here to skip the gradient work.
    return _loss_and_grads(hidden, weight, bias, targets, chunk_size, (False,) * 3)[0]


# ---- wiring it into a model -----------------------------------------------------------------


def _fused_lm_head_forward(self: nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
    """The head's forward after install: the loss (sum or per token) while targets are
    pending, else logits.

    The targets are consumed by the first call, so a second call of the head in the same
    model forward returns plain logits instead of counting the loss twice.
    """
    pending = getattr(self, _PENDING, None)
    if pending is None:
        return nn.Linear.forward(self, hidden_states)
    setattr(self, _PENDING, None)
    targets, reduction = pending
    loss_fn = _per_token_loss_fn() if reduction == "token" else linear_cross_entropy_sum
    loss = loss_fn(hidden_states, self.weight, targets, self.bias)
    # Kept so the loss function can check that the model returned it unchanged.
    setattr(self, _FUSED_LOSS, loss)
    return loss


def _per_token_loss_fn():
    # Imported here: fused_ce_token builds on this module's chunking helpers.
    from swiftlm.losses.fused_ce_token import linear_cross_entropy_per_token

    return linear_cross_entropy_per_token


def _is_plain_linear(module) -> bool:
    # Subclasses with their own forward (bitsandbytes Linear4bit/8bitLt, peft layers) are out;
    # FSDP2 turns the class into an FSDP subclass without a forward of its own, which is fine.
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _transforms_logits(model) -> bool:
    config = getattr(model, "config", None)
    if config is None:
        return False
    configs = [config]
    if hasattr(config, "get_text_config"):
        configs.append(config.get_text_config())
    return any(
        getattr(c, name, None) not in neutral
        for c in configs
        for name, neutral in _LOGIT_TRANSFORMS.items()
    )


def install_fused_lm_head(model) -> bool:
    """Make the model's output Linear compute the fused loss when `fused_causal_lm_loss` asks.

    Call it on the model (plain or peft) before DDP / FSDP2 / DeepSpeed wrap it. Returns False
    and leaves the model untouched when there is nothing it can fuse: no output embeddings,
    a head that is not a plain nn.Linear (peft-wrapped lm_head, quantized head), or a model
    that changes the logits after the head (soft-capping, logit scaling). The loss function
    then falls back to the plain loss. Installing twice is harmless.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not _is_plain_linear(head) or _transforms_logits(model):
        return False
    if not getattr(head, _MARKER, False):
        head.forward = types.MethodType(_fused_lm_head_forward, head)
        setattr(head, _PENDING, None)
        setattr(head, _FUSED_LOSS, None)
        setattr(head, _MARKER, True)
    return True


def uninstall_fused_lm_head(model) -> bool:
    """Undo `install_fused_lm_head`; True if a fused head was found and restored."""
    head = find_fused_lm_head(model)
    if head is None:
        return False
    for name in ("forward", _PENDING, _FUSED_LOSS, _MARKER):
        delattr(head, name)
    return True


def find_fused_lm_head(model) -> nn.Linear | None:
    """The head marked by `install_fused_lm_head`, looked up through any wrapper.

    The mark lives on the head module itself and is found by walking `model.modules()`,
    because every wrapper keeps the model as a submodule (DDP and DeepSpeed as `.module`,
    peft as `.base_model.model`, torch.compile as `._orig_mod`) and FSDP2 shards in place.
    A mark on the top-level object, or a dict keyed by it, would be lost as soon as a
    wrapper replaced it. The walk costs microseconds per call.
    """
    heads = [m for m in model.modules() if getattr(m, _MARKER, False)]
    if len(heads) > 1:
        raise ValueError(f"{len(heads)} fused lm heads in one model; expected one")
    return heads[0] if heads else None


def fused_causal_lm_loss(
    model, batch: dict[str, torch.Tensor], reduction: str = "sum"
) -> tuple[torch.Tensor, dict]:
    """loss_fn(model, batch) -> (sum of token losses, metrics), the contract of
    `causal_lm_loss`, without materializing logits; with reduction="token" the float32
    token losses `[rows, width]` like labels, aligned with the shifted labels, 0 where no
    label. Without a fused head (see `install_fused_lm_head`) it computes the plain loss."""
    check_reduction(reduction)
    head = find_fused_lm_head(model)
    if head is None:
        return causal_lm_loss(model, batch, reduction=reduction)
    setattr(head, _PENDING, (shifted_labels(batch["labels"]), reduction))
    try:
        # All positions reach the head: transformers' default logits_to_keep=0 keeps them,
        # and without labels the model computes no loss of its own from the "logits".
        # No KV cache: with one, transformers ignores the sample boundaries of packed rows.
        outputs = model(**model_inputs(batch), use_cache=False)
        fused_loss = getattr(head, _FUSED_LOSS)
    finally:
        setattr(head, _PENDING, None)
        setattr(head, _FUSED_LOSS, None)
    return _checked_loss(outputs.logits, fused_loss), {}


def _checked_loss(returned, fused_loss: torch.Tensor | None) -> torch.Tensor:
    """The loss as the (wrapped) model returned it, after checking it is the fused loss.

    The returned tensor, not the one the head made, is what backward must start from:
    DeepSpeed ZeRO-3 swaps module outputs for copies whose backward re-gathers the weights,
    and starting from the original would skip that. A model that transforms the head's
    output (a scale, a soft-cap) would silently turn the loss into something else, so that
    raises; a wrapper that only casts outputs (FSDP2 output_dtype) keeps the float32 value.
    Per-token losses are checked the same way, element by element: same shape, and every
    value the fused one (after the wrapper's cast); a transform changes any nonzero loss.
    """
    if fused_loss is None:
        raise RuntimeError(
            "the fused lm_head was not called during the model's forward: this model does "
            "not compute its logits through get_output_embeddings(); use the plain loss"
        )
    if returned is fused_loss:
        return returned
    if (
        isinstance(returned, torch.Tensor)
        and returned.shape == fused_loss.shape
        and _same_value(returned, fused_loss.to(returned.dtype))
    ):
        if returned.dtype == fused_loss.dtype:
            return returned
        # Rounded to a low-precision dtype by the wrapper: the value of the float32 loss,
        # the gradient path through what the wrapper returned.
        return returned.float() + (fused_loss.detach() - returned.detach().float())
    raise RuntimeError(
        "the model changed the output of its lm_head (e.g. logit soft-capping or scaling), "
        "so the fused loss would be wrong: do not install the fused head for this model"
    )


def _same_value(a: torch.Tensor, b: torch.Tensor) -> bool:
    # NaN equals NaN here: a diverged step must reach the loop's non-finite-loss handling,
    # not fail as a model that transforms its logits.
    return torch.allclose(a.detach(), b.detach(), rtol=0.0, atol=0.0, equal_nan=True)
