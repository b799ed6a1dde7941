"""Sampling a LoRA policy on merged weights, without touching the trained module.

A LoRA layer's forward is the base product plus four more (A, B, the scaling and the sum),
and a decode step of a small batch is bound by the number of operators, not their size:
sampling through the adapter cost 1.12x sampling on merged weights (SmolLM2-135M, 8 rows,
2 CPU cores). So for a generation each adapted Linear gets W + scale x B @ A as its weight
and the adapters are switched off; afterwards the original weight tensors go back. They are
never written (a merge and unmerge in place would round W a little at every step, so the
reference, the base with the adapter off, and a resumed run would drift). The cost is one
more copy of the adapted weights while sampling, when no activations are held.

Layers whose update is not a plain B @ A on a Linear's weight (DoRA, LoRA biases, QLoRA's
quantized bases, `modules_to_save` copies, which switching adapters off would also undo)
keep sampling through the adapter.
"""

import contextlib

import torch


def _mergeable_layers(policy) -> list | None:
    """The active adapter's LoRA layers when every one can be merged as above, else None."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    if not isinstance(policy, PeftModel) or len(policy.active_adapters) != 1:
        return None
    adapter = policy.active_adapter
    if str(policy.peft_config[adapter].peft_type.value) != "LORA":
        return None
    layers = []
    for module in policy.get_base_model().modules():
        if isinstance(module, ModulesToSaveWrapper):
            return None
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        base = module.get_base_layer()
        plain = type(base) is torch.nn.Linear and base.weight.is_floating_point()
        variant = adapter in module.lora_variant or module.use_dora.get(adapter)  # DoRA ...
        if not plain or variant or module.lora_bias.get(adapter):
            return None
        layers.append(module)
    return layers or None


@contextlib.contextmanager
def merged_adapter_weights(policy):
    """Within: `policy` (a PeftModel, or anything: then nothing changes) computes with its
    adapter merged into its base weights and the adapter layers off."""
    layers = _mergeable_layers(policy)
    if layers is None:
        yield
        return
    adapter = policy.active_adapter
    originals = []
    try:
        with torch.no_grad():
            for layer in layers:
                base = layer.get_base_layer()
                weight = base.weight
                merged = weight + layer.get_delta_weight(adapter).to(weight.dtype)
                originals.append((base, weight))
                base.weight = torch.nn.Parameter(merged, requires_grad=False)
        with policy.disable_adapter():
            yield
    finally:
        for base, weight in originals:
            base.weight = weight
