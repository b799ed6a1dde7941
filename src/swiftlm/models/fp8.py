"""FP8 training of the decoder's linear layers (`--fp8_recipe tensorwise|rowwise`), through
torchao's float8 training (`torchao.float8.convert_to_float8_training`).

Each converted `nn.Linear` becomes torchao's `Float8Linear`: its input, weight and output
gradient are cast to float8 (e4m3 forward, e5m2 for gradients as the recipe says) with
dynamic scales, one per tensor (`tensorwise`) or one per row (`rowwise`), and its three
products run as scaled float8 matmuls. The weights themselves stay in their precision (the
optimizer and the checkpoint see ordinary tensors), so a saved model is an ordinary model.

Left in high precision, as torchao and torchtitan advise:
- the LM head (the output embeddings): the logits' precision decides the loss;
- layers whose dims are not multiples of 16 (the float8 GEMM's hardware requirement), which
  covers routers and small gates;
- on CUDA, the layers torchao's measured thresholds say are faster in bf16 than in float8
  (`_auto_filter_for_recipe`: small K/N, from H100 benchmarks);
- the stacked experts of a mixture-of-experts model (3-D weights, not `nn.Linear`).

Without an FP8 GPU (compute capability 8.9+), torchao *emulates* the float8 matmuls: the
casts and scales are the same, the products run in high precision. That runs the numerics of
FP8 training anywhere (CPU tests), not its speed; the log says which one runs.
"""

import torch

from swiftlm.errors import ConfigError

FP8_RECIPES = ("tensorwise", "rowwise")


def fp8_hardware(device: torch.device) -> bool:
    """Whether `device` multiplies float8 natively (Ada/Hopper and later GPUs)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _converted_layers(model: torch.nn.Module, recipe: str, native: bool):
    """The filter torchao calls per module: decoder Linear layers, not the LM head, with
    dims divisible by 16 and, where float8 runs natively, above torchao's size thresholds."""
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    sized = _auto_filter_for_recipe(recipe, filter_fqns=[]) if native else None

    def convert(module: torch.nn.Module, name: str) -> bool:
        if not isinstance(module, torch.nn.Linear) or module is head:
            return False
        out_features, in_features = module.weight.shape
        if out_features % 16 or in_features % 16:
            return False
        return sized(module, name) if sized is not None else True

    return convert


def apply_fp8_training(model: torch.nn.Module, recipe: str, device: torch.device) -> str:
    """Convert `model`'s eligible linear layers for float8 training; returns a log line."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise ConfigError(
            f"--fp8_recipe {recipe}: needs torchao ({exc}); pip install 'swiftlm[quant]'"
        ) from None
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    native = fp8_hardware(device)
    config = Float8LinearConfig.from_recipe_name(recipe)
    config = Float8LinearConfig(**{**vars(config), "emulate": not native})
    convert_to_float8_training(
        model, config=config, module_filter_fn=_converted_layers(model, recipe, native)
    )
    converted = sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
    if not converted:
        raise ConfigError(
            f"--fp8_recipe {recipe}: no linear layer of this model can run in float8 (their "
            "dims are not multiples of 16, or they are the LM head); drop the flag"
        )
    how = "native float8 matmuls" if native else f"emulated on {device.type}: numerics, not speed"
    return (
        f"fp8 training ({recipe} scaling, {how}): {converted} of {len(linear)} linear layers "
        "in float8; the LM head and layers with dims not multiples of 16 stay in "
        f"{'bf16' if native else 'their precision'}"
    )
