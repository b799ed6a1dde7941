"""Linear weights reordered once for oneDNN, for serving a bf16 model on a CPU.

A bf16 `nn.Linear` on a CPU runs through oneDNN, which reorders the weight into its blocked
layout on every call. For a decode step that is most of the product's time: the weights are
read twice. `PackedLinear` holds the weight already reordered (`mkldnn._reorder_linear_weight`,
what inductor's freezing pass does for a compiled CPU graph) and multiplies with
`mkldnn._linear_pointwise`: the same oneDNN kernel on the same numbers, without the reorder.
Measured on SmolLM2-135M's products: 1.4-2.3x per product, 1.2-1.3x per decode step
(`benchmarks/serving.py`, docs/benchmarks.md).

The reordered weight is an opaque oneDNN tensor: nothing else can read it (no state dict, no
`.to()`, no backward). So only an engine over fixed weights packs (deploy, infer, eval), never
the rollout engine of a model that trains. The original weight is freed, so memory stays the
same, except for a head tied to the embedding, which keeps the embedding and adds the packed
head. Layers whose forward reads the base weight (DoRA's magnitude) stay as loaded; a LoRA
layer's own A and B stay too (peft reads their `.weight`), while its base layer is packed.
"""

from contextlib import contextmanager

import torch
from torch import nn


class PackedLinear(nn.Module):
    """An `nn.Linear` for inference whose weight oneDNN reordered once."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # A plain attribute, not a buffer: an opaque tensor has no storage to save or move.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = linear.bias
        # For parameter counts in reports: the weight's size, and where it lived (a head tied
        # to the embedding is still counted there).
        self.weight_numel = linear.weight.numel()
        self.weight_address = linear.weight.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


def why_not_packable(model) -> str | None:
    """Why this model's linear layers cannot be packed here, or None when they can."""
    weight = next(model.parameters())
    if weight.device.type != "cpu":
        return f"the model is on {weight.device.type}, and packing is for CPUs"
    if weight.dtype != torch.bfloat16:
        return (
            f"the weights are {str(weight.dtype).removeprefix('torch.')}, and packing is for bf16"
        )
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return "this CPU's oneDNN has no bf16 kernels"
    return None


def pack_linear_weights(model) -> int:
    """Replace each plain `nn.Linear` of `model` by a `PackedLinear`; the number replaced."""
    kept = _kept_for_adapters(model)
    targets = [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and id(module) not in kept
    ]
    with one_thread():
        for name in targets:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, PackedLinear(getattr(parent, child)))
    return len(targets)


@contextmanager
def one_thread():
    """Reorder on the calling thread alone. A multi-threaded reorder would give this (loading)
    thread an OpenMP team of its own beside the one the engine's loop thread makes; with more
    OpenMP threads than cores, libgomp stops spinning between parallel regions, and every
    operator then waits for a sleeping worker to wake: measured, a decode step of the default
    model went from 29 to 62 ms on 2 cores. Packing on one thread takes about 1 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _kept_for_adapters(model) -> set[int]:
    """The ids of the modules that must keep their `.weight`: within each peft tuner layer
    everything but its base layer (peft reads A's and B's weights), and the base layer too
    where a variant such as DoRA reads it."""
    kept = set()
    for module in model.modules():
        if getattr(module, "adapter_layer_names", None) is None:  # not a peft tuner layer
            continue
        for child_name, child in module.named_children():
            if child_name != "base_layer" or getattr(module, "lora_variant", None):
                kept.update(id(part) for part in child.modules())
    return kept


def parameter_count(model) -> int:
    """Parameters of `model`, packed weights included."""
    parameters = list(model.parameters())
    live = {p.data_ptr() for p in parameters}
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    return sum(p.numel() for p in parameters) + sum(
        m.weight_numel for m in packed if m.weight_address not in live
    )
