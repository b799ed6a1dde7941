"""The fused LM-head loss in a model: a causal LM's loss without its logits.

`chunked_ce` computes the head and cross-entropy chunk by chunk from the hidden states; this
module gets the hidden states to it from inside the model's own forward, through whatever
wraps the model (peft, DDP, FSDP2, DeepSpeed), so that every wrapper still runs its hooks
and DDP its gradient sync:

* `install_fused_lm_head(model)` gives the model's `lm_head` Linear an instance-level
  `forward` that returns the loss instead of logits while targets are pending on it, and
  the plain logits otherwise (generation and evaluation are unchanged). Parameter names,
  the state dict and the module hooks of FSDP2 / DeepSpeed ZeRO-3 (which gather the weight
  before forward) stay exactly as they were.
* `fused_causal_lm_loss(model, batch)` puts the shifted labels on that head, calls the
  (wrapped) model's normal forward and returns the loss sum that came out as
  `outputs.logits`, after checking it is the head's loss unchanged. With reduction="token"
  the head returns the per-token losses instead.
"""

import types

import torch
from torch import nn

from swiftlm.data.collate import model_inputs
from swiftlm.losses.causal_lm import causal_lm_loss, check_reduction, shifted_labels
from swiftlm.losses.chunked_ce import linear_cross_entropy_per_token, linear_cross_entropy_sum

# Attributes set on the head module instance. Plain (non-Parameter) attributes never reach
# the state dict.
_MARKER = "_swiftlm_fused_ce"
_PENDING = "_swiftlm_pending"  # (shifted targets, reduction) for the next head call
_FUSED_LOSS = "_swiftlm_fused_loss"
_LIGER = "_swiftlm_liger"  # True: Liger's fused linear cross-entropy (--use_liger_kernel)

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
    if getattr(self, _LIGER):
        from swiftlm.models.liger import liger_cross_entropy

        per_token = reduction == "token"
        loss = liger_cross_entropy(hidden_states, self.weight, targets, self.bias, per_token)
    else:
        loss_fn = (
            linear_cross_entropy_per_token if reduction == "token" else linear_cross_entropy_sum
        )
        loss = loss_fn(hidden_states, self.weight, targets, self.bias)
    # Kept so the loss function can check that the model returned it unchanged.
    setattr(self, _FUSED_LOSS, loss)
    return loss


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


def install_fused_lm_head(model, liger: bool = False) -> bool:
    """Make the model's output Linear compute the fused loss when `fused_causal_lm_loss` asks
    (swiftlm's chunked one, or with `liger` Liger's fused linear cross-entropy).

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
    setattr(head, _LIGER, liger)
    return True


def uninstall_fused_lm_head(model) -> bool:
    """Undo `install_fused_lm_head`; True if a fused head was found and restored."""
    head = find_fused_lm_head(model)
    if head is None:
        return False
    for name in ("forward", _PENDING, _FUSED_LOSS, _MARKER, _LIGER):
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
