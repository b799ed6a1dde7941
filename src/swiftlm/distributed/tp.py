"""Tensor parallel with DTensor: each decoder block's projections are split over the mesh's
"tp" dimension.

The plan is Megatron's, for Llama/Qwen/Mistral-style blocks: q/k/v and gate/up are split by
output features (column-wise), o and down by input features (row-wise), so each block needs one
all-reduce in attention and one in the MLP. Embeddings, norms and the LM head stay replicated.
Every rank of a TP group sees the same batch.

LoRA: peft wraps a projection in a LoraLayer, output = base_layer(x) + lora_B(lora_A(x)) * s.
The base layer is split as the plain projection would be; the adapter follows so that the sum
stays a sum of local pieces. Column-wise: lora_A stays whole (every rank computes the same
rank-r code), lora_B is split by output features like the base. Row-wise: lora_A is split by
input features like the base (its partial sums are all-reduced to the full code), lora_B stays
whole and adds the same update on every rank as the base's all-reduced output.
"""

from torch import nn

from swiftlm.errors import ConfigError

# Llama-family block: module path inside a decoder layer -> split style.
BLOCK_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
# The adapter matrix of a LoraLayer that is split like its base, per style (the other stays whole).
LORA_SPLIT = {"colwise": "lora_B", "rowwise": "lora_A"}


def check_divisible(config, size: int) -> None:
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name, None)
        if value is not None and value % size:
            raise ConfigError(
                f"--tensor_parallel_size {size}: the model's {name} ({value}) is not divisible by it"
            )


def _is_lora_layer(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def layer_plan(layer: nn.Module) -> dict[str, str]:
    """{module path inside `layer`: "colwise" | "rowwise"} for one decoder block, adapters
    included."""
    plan = {}
    for path, style in BLOCK_PLAN.items():
        module = layer.get_submodule(path)
        if not _is_lora_layer(module):
            plan[path] = style
            continue
        if any(module.use_dora.values()):
            raise ConfigError(
                "--tensor_parallel_size with --train_type dora: DoRA normalizes each full "
                "weight column, which tensor parallel splits; use lora, or fsdp2 for DoRA"
            )
        plan[f"{path}.base_layer"] = style
        for adapter in module.lora_A:
            plan[f"{path}.{LORA_SPLIT[style]}.{adapter}"] = style
    return plan


def apply_tensor_parallel(model: nn.Module, layers: nn.ModuleList | None, tp_mesh) -> None:
    """Split every decoder block of `layers` over `tp_mesh` (in place)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    layers = tensor_parallel_layers(model, layers)
    check_divisible(model.config, tp_mesh.size())
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in layers:
        plan = {path: styles[style]() for path, style in layer_plan(layer).items()}
        parallelize_module(layer, tp_mesh, plan)


def tensor_parallel_layers(model: nn.Module, layers: nn.ModuleList | None) -> nn.ModuleList:
    """The decoder blocks tensor parallel splits, or a clear error for other models."""
    if layers is None or not all(_has_plan_paths(layer) for layer in layers):
        raise ConfigError(
            f"--tensor_parallel_size: {type(model).__name__} has no decoder `layers` of "
            "Llama-style blocks (self_attn.q_proj ... mlp.down_proj); tensor parallel supports "
            "Llama/Qwen2/Mistral-style models"
        )
    return layers


def _has_plan_paths(layer: nn.Module) -> bool:
    names = {name for name, _ in layer.named_modules()}
    return all(path in names for path in BLOCK_PLAN)
