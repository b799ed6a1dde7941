"""Liger's Triton kernels (`--use_liger_kernel`, ms-swift's flag): on a CUDA device, the
model's RMSNorm, RoPE and SwiGLU MLP run as Liger's fused kernels, and the fused LM-head
loss (`--fused_cross_entropy`, SFT and pre-training) runs as Liger's fused linear
cross-entropy instead of swiftlm's chunked one.

What stays swiftlm's: the preference and RL losses. They already read per-token log-probs
chunked from the hidden states without `[tokens, vocab]` logits (`losses.chunked_ce`), for
every `--loss_type`; Liger's fused DPO/KTO losses cover fewer variants and would bypass the
padding-free answer layout.

Liger (`liger-kernel`, the `liger` extra) is imported only here and only when asked for: its
kernels are Triton kernels, which need a CUDA GPU, so a CPU run refuses the flag by name.
"""

import torch

from swiftlm.errors import ConfigError

INSTALL = "pip install 'swiftlm[liger]' (liger-kernel with Triton, for CUDA GPUs)"


def check_liger(device: torch.device) -> None:
    """Raise a ConfigError naming the flag and the fix unless Liger can run on `device`."""
    if device.type != "cuda":
        raise ConfigError(
            f"--use_liger_kernel: Liger's kernels are Triton kernels for CUDA GPUs, and this "
            f"run trains on {device.type}; drop --use_liger_kernel (on a CPU, "
            "--fused_cross_entropy true, the default, already computes the LM head and the "
            "loss in chunks without the [tokens, vocab] logits)"
        )
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"--use_liger_kernel needs liger-kernel, which does not import here ({exc}); "
            f"{INSTALL}, or drop --use_liger_kernel"
        ) from exc


def apply_liger_kernels(model: torch.nn.Module, device: torch.device) -> None:
    """Swap `model`'s RMSNorm, RoPE and SwiGLU for Liger's kernels, in place (before the
    tuner wraps it: Liger finds the layers on the transformers model). The LM head is left
    alone; `liger_cross_entropy_sum` is what the fused loss calls instead."""
    check_liger(device)
    from liger_kernel.transformers.monkey_patch import (
        MODEL_TYPE_TO_APPLY_LIGER_FN,
        _apply_liger_kernel_to_instance,
    )

    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        known = ", ".join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))
        raise ConfigError(
            f"--use_liger_kernel: liger-kernel has no kernels for model type {model_type!r} "
            f"(it has: {known}); drop --use_liger_kernel for this model"
        )
    _apply_liger_kernel_to_instance(
        model=model,
        rope=True,
        rms_norm=True,
        swiglu=True,
        cross_entropy=False,
        fused_linear_cross_entropy=False,  # the head stays a Linear: swiftlm's fused loss
    )


def liger_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    per_token: bool,
) -> torch.Tensor:
    """Liger's fused head + cross-entropy for hidden `[..., H]` and shifted targets `[...]`
    (-100 = ignore): the sum over label tokens, or (`per_token`) float32 losses shaped like
    targets with 0 where ignored, the two contracts of `losses.chunked_ce`."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).to(hidden.device)
    loss = liger_fused_linear_cross_entropy(
        flat_hidden,
        weight,
        flat_targets,
        bias=bias,
        ignore_index=-100,
        reduction="none" if per_token else "sum",
        accum_dtype=torch.float32,
    )
    if per_token:
        return loss.float().masked_fill(flat_targets == -100, 0.0).reshape(targets.shape)
    return loss.float()
