"""`--per_device_train_batch_size auto`: the largest micro-batch that fits.

On a GPU the answer is probed: real forward and backward passes at --max_length with growing
batch sizes until one runs out of memory. On a CPU running out of memory means swapping or
the OOM killer, so the batch is planned instead: the activation bytes a token keeps for the
backward pass (per layer, from the model's shapes) against the memory that is free after the
weights, gradients and AdamW states.
"""

import torch

from swiftlm.errors import ConfigError

MAX_AUTO_BATCH = 64
# Plan with part of the free memory: allocator fragmentation, the OS and peaks the estimate
# does not see (optimizer step temporaries, collation) need the rest.
CPU_MEMORY_SHARE = 0.6


def activation_bytes_per_token(config, compute_dtype: torch.dtype, checkpointing: bool) -> float:
    """Bytes of activations a token keeps for backward in a Llama-style decoder.

    Per layer: the inputs of the two norms, q/k/v, the attention output and o_proj input
    (~6 hidden-sized tensors, SDPA stores no score matrix), plus gate, up, the activation and
    their product (4 intermediate-sized tensors), in the compute dtype, plus the residual
    stream in float32. Gradient checkpointing keeps one hidden state per layer plus one
    layer's worth being recomputed.
    """
    hidden, layers = config.hidden_size, config.num_hidden_layers
    intermediate = getattr(config, "intermediate_size", 4 * hidden)
    width = torch.finfo(compute_dtype).bits // 8
    per_layer = width * (6 * hidden + 4 * intermediate) + 4 * 2 * hidden
    if checkpointing:
        return 4 * hidden * layers + per_layer
    return per_layer * layers


def training_state_bytes(model: torch.nn.Module) -> int:
    """Gradients plus AdamW's two moments (float32) of the trainable parameters."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable * 4 * 3


def free_cpu_bytes() -> int:
    import psutil

    return psutil.virtual_memory().available


def planned_cpu_batch(
    model, max_length: int, compute_dtype: torch.dtype, checkpointing: bool, free: int
) -> int:
    per_sample = max_length * activation_bytes_per_token(model.config, compute_dtype, checkpointing)
    budget = free * CPU_MEMORY_SHARE - training_state_bytes(model)
    return max(1, min(MAX_AUTO_BATCH, int(budget // per_sample)))


def _fits_on_gpu(model, loss_fn, batch_size: int, max_length: int, device, dtype) -> bool:
    ids = torch.randint(0, model.config.vocab_size, (batch_size, max_length), device=device)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    try:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss, _ = loss_fn(model, batch)
        loss.backward()
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()


def probed_gpu_batch(model, loss_fn, max_length: int, device, dtype) -> int:
    """Double until a step runs out of memory; keep 80% of the largest that fit, since the
    optimizer states are not allocated yet during the probe."""
    size = 1
    if not _fits_on_gpu(model, loss_fn, 1, max_length, device, dtype):
        raise ConfigError(
            f"one sample of --max_length {max_length} does not fit on {device}; lower "
            "--max_length, or use --gradient_checkpointing true / LoRA / --strategy fsdp2"
        )
    while size < MAX_AUTO_BATCH and _fits_on_gpu(
        model, loss_fn, size * 2, max_length, device, dtype
    ):
        size *= 2
    return max(1, int(size * 0.8))


def auto_batch_size(
    model, loss_fn, max_length: int, device, dtype, checkpointing: bool
) -> tuple[int, str]:
    """(batch size, how it was chosen) for the log."""
    if device.type == "cuda":
        size = probed_gpu_batch(model, loss_fn, max_length, device, dtype)
        return size, f"probed on {device} at --max_length {max_length}"
    free = free_cpu_bytes()
    size = planned_cpu_batch(model, max_length, dtype, checkpointing, free)
    return size, (
        f"planned from {free / 2**30:.1f} GiB free memory at --max_length {max_length} "
        f"({activation_bytes_per_token(model.config, dtype, checkpointing) * max_length / 2**20:.0f} "
        "MiB of activations per sample)"
    )
