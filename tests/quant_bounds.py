"""How far a quantized model's linear layers are from the float weights they were made from,
against each format's own rounding bound (the bnb and torchao exports, CPU and CUDA).

The weights a layer applies are read by running it on the identity matrix (x = I gives
x W^T = W^T), whatever kernel and storage its format has: nothing format-specific to unpack.

The bound. Each format rounds a weight to the nearest of its levels, spaced in proportion to
the absmax of the weight's block (a row for the int8 formats, 64 weights for bitsandbytes
4-bit, a --group_size group for int4). In the tiny test Llamas every block lies inside one row,
so the row's absmax bounds the block's. Round-to-nearest moves a weight by at most half the
widest gap between two neighbouring levels, as a fraction of that absmax (HALF_STEP):

- bnb8, LLM.int8: each row scaled to [-127, 127]: 1/254.
- int8, torchao, symmetric per row, scale absmax/127.5: 1/255.
- int4, torchao per group: symmetric [-8, 7] with scale absmax/7.5 (CPU) or asymmetric
  [0, 15] with scale (max - min)/15 <= 2 absmax/15 (CUDA's tinygemm): 1/15.
- bnb4, NF4 (the default --bnb_4bit_quant_type): its widest gap, -1 to -0.6962, halved: 0.1519.

On top, the model's dtype (bfloat16 on CUDA and on CPUs with native bf16) rounds up to four
times, each by its unit roundoff u = eps/2 of a value at most about the row's absmax: the source
weight cast to it before quantizing, the scale and (tinygemm) zero point stored in it, and the
layer's output. 5u leaves room for the values being up to a half step above the absmax:
0.0195 in bfloat16. LLM.int8 (bnb8) casts its input and output through float16 whatever the
model's dtype, so its rounding is float16's when the model computes in float32 (CPUs without
native bf16). Double quantization (bnb4's default) also rounds each block's absmax, less
the mean absmax, to bitsandbytes' 8-bit dynamic map in blocks of 256: at most half that map's
widest gap, 0.00703, of the whole tensor's absmax.

Every bug this is for (a wrong or missing scale, a transposed or misaligned block, levels
unpacked in the wrong order, a layer left random) moves weights by a sizeable fraction of the
absmax, well above these bounds; and 4-bit blocks must hold at most 16 distinct values.
"""

from __future__ import annotations

from pathlib import Path

import torch

HALF_STEP = {"bnb8": 1 / 254, "int8": 1 / 255, "int4": 1 / 15, "bnb4": 0.1519}
DOUBLE_QUANT = {"bnb4": 0.00703}
# A format that computes in its own dtype, whatever the model's (see the module docstring).
COMPUTE_DTYPE = {"bnb8": torch.float16}
BITS = {"bnb8": 8, "int8": 8, "int4": 4, "bnb4": 4}
# The `swiftlm export` flags of each format, and the weights per scale of the 4-bit ones:
# bitsandbytes' block, int4's --group_size default (it divides the wide tiny Llama's input
# widths, 128 and 256).
EXPORT_FLAGS = {
    "bnb4": ["--quant_method", "bnb", "--quant_bits", "4"],
    "bnb8": ["--quant_method", "bnb", "--quant_bits", "8"],
    "int8": ["--quant_method", "int8"],
    "int4": ["--quant_method", "int4"],
}
BLOCKS = {"bnb4": 64, "int4": 128}


def applied_weight(layer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The [out, in] weight `layer` applies, in float32 on the CPU: its output for the identity
    matrix in `dtype` (the model's compute dtype), transposed. The test Llamas have no bias."""
    assert getattr(layer, "bias", None) is None, "a bias would be added to every row"
    device = next(t.device for t in [*layer.parameters(), *layer.buffers()])
    with torch.no_grad():
        eye = torch.eye(layer.in_features, dtype=dtype, device=device)
        return layer(eye).T.float().cpu()


def assert_weights_within_quantization_bound(
    model, source_folder: Path, kind: str, block: int | None = None
) -> int:
    """Assert every quantized linear layer of `model` (all but the output head) applies the
    float weights in `source_folder`/model.safetensors within `kind`'s rounding bound (see the
    module docstring), and, for 4-bit kinds, that each `block` of consecutive weights of a row
    holds at most 16 distinct values. Returns how many layers were checked."""
    from safetensors.torch import load_file

    source = load_file(Path(source_folder) / "model.safetensors")
    dtype = model.get_input_embeddings().weight.dtype
    eps = max(torch.finfo(dtype).eps, torch.finfo(COMPUTE_DTYPE.get(kind, dtype)).eps)
    slack = 5 * eps / 2
    head = model.get_output_embeddings()
    checked = 0
    for name, layer in model.named_modules():
        if layer is head or not hasattr(layer, "in_features"):
            continue
        want = source[f"{name}.weight"].float()
        got = applied_weight(layer, dtype)
        assert got.shape == want.shape, f"{name}: {tuple(got.shape)} against {tuple(want.shape)}"
        row_absmax = want.abs().amax(dim=1, keepdim=True)
        bound = (HALF_STEP[kind] + slack) * row_absmax
        bound = bound + DOUBLE_QUANT.get(kind, 0.0) * want.abs().max()
        excess = ((got - want).abs() / bound).max().item()
        assert excess <= 1.0, (
            f"{kind} {name}: a weight is {excess:.3g} times its rounding bound from the source "
            f"(half step {HALF_STEP[kind]:.4g} + {slack:.3g} of its row's absmax)"
        )
        if BITS[kind] == 4:
            assert block is not None and want.shape[1] % block == 0, f"{name}: block {block}?"
            blocks = got.reshape(-1, block)
            levels = max(len(torch.unique(b)) for b in blocks)
            assert levels <= 16, f"{kind} {name}: a block of {block} holds {levels} values"
        checked += 1
    assert checked, "no quantized linear layer found"
    return checked
