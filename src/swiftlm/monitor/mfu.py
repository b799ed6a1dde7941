"""Model FLOPs utilization: the matmul work a training step needs, over what the device can do.

FLOPs per token count the multiply-adds of every linear layer (2 FLOPs per weight per token
forward), with the backward pass at twice the forward when weights train and once the forward
when they are frozen (only activation gradients: LoRA's base), plus causal attention's
score and value products. The peak is a table value for known GPUs, and otherwise measured
once with a matmul probe in the compute dtype and cached (CPUs differ too much for a table).
"""

import json
import time

import torch

from swiftlm.models.loader import cache_root

# Dense bf16/fp16 tensor-core peaks per GPU (FLOP/s), from the vendors' data sheets.
GPU_PEAKS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "L4": 121e12,
    "4090": 165e12,
    "3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
}
PROBE_SIZE = 1024


def linear_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(all, trainable) weights of the matmuls one token runs: linear layers, the LM head
    (tied or not) and, in a mixture-of-experts model, the share top_k / experts of the stacked
    expert weights (only the experts a token is routed to compute for it)."""
    from swiftlm.models.moe import expert_parameters
    from swiftlm.models.quant import logical_numel  # 4-bit weights pack two per byte

    total = trainable = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and weight is not None:
            total += logical_numel(weight)
            trainable += logical_numel(weight) if weight.requires_grad else 0
    _, active, active_trained = expert_parameters(model)
    return total + active, trainable + active_trained


def flops_per_token(model: torch.nn.Module, seq_len: int, recompute: bool = False) -> float:
    """Training FLOPs per token: forward, backward and (with checkpointing) recomputation."""
    total, trainable = linear_parameters(model)
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", 0) or 0
    hidden = getattr(config, "hidden_size", 0) or 0
    forward = 2 * total + 2 * layers * hidden * seq_len  # causal attention: half of 4·L·d·T
    backward = 2 * forward if trainable == total else forward + 2 * trainable
    return forward + backward + (forward if recompute else 0)


def measure_peak(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a square matmul in `dtype` on `device` (best of a few timed runs)."""
    a = torch.randn(PROBE_SIZE, PROBE_SIZE, device=device).to(dtype)
    b = torch.randn(PROBE_SIZE, PROBE_SIZE, device=device).to(dtype)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - start) / 4)
    return 2 * PROBE_SIZE**3 / best


def _probe_key(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = next(
            (line.split(":", 1)[1].strip() for line in _cpuinfo() if "model name" in line), "cpu"
        )
    return f"{device.type}|{name}|{dtype}|threads={torch.get_num_threads()}"


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """The device's peak for MFU: a GPU table value, else a cached matmul-probe measurement."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAKS.items():
            if key in name:
                return value
    cache = cache_root() / "peak_flops.json"
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    key = _probe_key(device, dtype)
    if key not in known:
        known[key] = measure_peak(device, dtype)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known, indent=1))
    return known[key]
