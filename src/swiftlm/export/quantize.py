"""`swiftlm export --quant_method bnb|int8|int4|gptq|awq`: a quantized Hugging Face folder that
`AutoModelForCausalLM.from_pretrained(folder)` loads as it is (the quantization config is
in its config.json), checked before returning.

- `bnb --quant_bits 4|8`: bitsandbytes NF4/FP4 (double quantization per the flags) or
  LLM.int8, in safetensors. Runs on CUDA and, with bitsandbytes >= 0.48, on CPUs.
- `int8`: torchao `Int8WeightOnlyConfig` (one scale per output row), in safetensors.
- `int4`: torchao weight-only int4 with one scale per `--group_size` weights. What torchao
  0.18 can both run and save depends on the device the folder is made for (`--device`):
  - CUDA: `Int4WeightOnlyConfig(int4_packing_format="tile_packed_to_4d")`, the tinygemm
    kernel: two weights per byte, bfloat16 activations, safetensors. (Not run by the tests,
    which have no GPU.)
  - CPU: `IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))`:
    4-bit values and group scales, safetensors, but each value is stored in its own int8
    byte, so the folder is as large as int8's; what it buys is int4's rounding without a
    CUDA kernel. torchao's packed CPU formats cannot be saved: the plain `Int4Tensor` needs
    the CUDA-only `mslk` kernels even to quantize, and `Int4OpaqueTensor` (CPU tinygemm) is
    not among the tensor types torchao's safetensors support accepts (transformers 5 saves
    nothing else).
- `gptq` / `awq`: calibrated on --dataset, by `swiftlm/export/calibrated.py`.

Weights that stay unquantized (embeddings, norms, the output head) are stored in the
--torch_dtype for the target device: bfloat16 on CUDA and on CPUs with native bf16, else
float32.

The export checks itself: the folder, read back by transformers from the folder alone, must
give a non-empty greedy answer to every check prompt, and its perplexity on the held-out text
may exceed the float32 source's by at most MAX_PPL_INCREASE (`checks.check_folder_read_back`,
shared with GPTQ/AWQ).
"""

import gc
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from swiftlm.config import ExportConfig
from swiftlm.config.rules_export import CALIBRATED_BITS, GROUP_SIZES, TORCHAO_BITS
from swiftlm.errors import ConfigError, ExportCheckError
from swiftlm.export.checks import (
    check_folder_read_back,
    folder_bytes,
    quantized_input_widths,
    source_perplexity,
)
from swiftlm.export.source import ExportSource
from swiftlm.models.config import QuantArguments
from swiftlm.models.loader import load_model, load_tokenizer, pick_device, pick_dtype
from swiftlm.models.quant import (
    bnb_bits,
    bnb_config,
    describe_bnb,
    import_bitsandbytes,
    import_torchao,
    silence_quantization_noise,
)

# What to try when the folder read back loses more perplexity than MAX_PPL_INCREASE allows.
PPL_FIX = "try --quant_bits 8, or a smaller --group_size for int4"


@dataclass(frozen=True)
class QuantPlan:
    """What one export writes: the transformers quantization config and how to describe it."""

    method: str
    bits: int
    label: str  # for the console, e.g. "bitsandbytes 4-bit nf4, double quantization"
    device: torch.device
    dtype: torch.dtype  # of the weights that stay unquantized (and of bnb's 4-bit matmuls)
    group_size: int | None = None  # int4: weights per scale


# ---- flags ----------------------------------------------------------------------------------


def validate(cfg: ExportConfig) -> None:
    """Fail fast, before anything loads, on what the device and the installed packages cannot
    do. The flags themselves have passed `rules.check` (bits, group size and bnb flags that
    fit --quant_method)."""
    q = cfg.quant
    if q.quant_method in CALIBRATED_BITS:
        _calibrated().validate_calibrated(cfg)
        return
    device = pick_device(cfg.model.device)
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"--quant_method {q.quant_method} on {device.type}: quantized exports are made for "
            "CPUs or CUDA GPUs; pass --device cpu or --device cuda"
        )
    dtype = pick_dtype(cfg.model.torch_dtype, device)
    if q.quant_method == "int4" and device.type == "cuda" and dtype != torch.bfloat16:
        raise ConfigError(
            f"--quant_method int4 on CUDA runs torchao's tinygemm kernel, which takes bfloat16 "
            f"only; drop --torch_dtype {cfg.model.torch_dtype} (or pass --torch_dtype bfloat16)"
        )
    if q.quant_method == "bnb":
        import_bitsandbytes()
    else:
        import_torchao(f"--quant_method {q.quant_method}")


def quant_bits(q: QuantArguments) -> int:
    """The bits of --quant_method bnb|int8|int4 (the rules `bnb_bits` and `torchao_bits` have
    made sure that --quant_bits, when given, agrees)."""
    if q.quant_method == "bnb":
        return bnb_bits(q)
    return TORCHAO_BITS[q.quant_method]


def _calibrated():
    """`swiftlm.export.calibrated` (GPTQ/AWQ), imported only when asked for."""
    from swiftlm.export import calibrated

    return calibrated


def plan_export(cfg: ExportConfig, model_path: str) -> QuantPlan:
    q = cfg.quant
    device = pick_device(cfg.model.device)
    dtype = pick_dtype(cfg.model.torch_dtype, device)
    bits = quant_bits(q)
    if q.quant_method == "bnb":
        return QuantPlan("bnb", bits, describe_bnb(q), device, dtype)
    if q.quant_method == "int8":
        return QuantPlan("int8", bits, "torchao int8 weight-only (per-row scales)", device, dtype)
    group_size = int4_group_size(model_path, q.group_size)
    kernel = "tinygemm" if device.type == "cuda" else "stored as int8"
    label = f"torchao int4 weight-only ({kernel}, group size {group_size})"
    return QuantPlan("int4", bits, label, device, dtype, group_size)


def int4_group_size(model_path: str, requested: int) -> int:
    """--group_size, or the largest of GROUP_SIZES below it that divides the input width
    of every layer to quantize (torchao refuses partial groups): SmolLM2-135M's 576-wide
    layers take 64, not the default 128. Read from the empty (meta) model, before any
    weight loads."""
    widths = quantized_input_widths(model_path)
    fitting = [g for g in GROUP_SIZES if g <= requested and all(w % g == 0 for w in widths)]
    if not fitting:
        raise ConfigError(
            f"--quant_method int4 --group_size {requested}: no group size of "
            f"{', '.join(map(str, GROUP_SIZES))} up to it divides this model's layer "
            f"input widths ({', '.join(map(str, sorted(widths)))}); use --quant_method int8 "
            "or --quant_method bnb"
        )
    if fitting[-1] != requested:
        print(
            f"--group_size {requested} does not divide this model's layer input widths "
            f"({', '.join(map(str, sorted(widths)))}); using {fitting[-1]}"
        )
    return fitting[-1]


def transformers_quantization(plan: QuantPlan, q: QuantArguments):
    """The quantization_config that `from_pretrained` applies while loading the source."""
    if plan.method == "bnb":
        return bnb_config(q, plan.dtype)
    from transformers import TorchAoConfig

    ao = import_torchao(f"--quant_method {plan.method}")
    if plan.method == "int8":
        return TorchAoConfig(ao.Int8WeightOnlyConfig())
    if plan.device.type == "cuda":
        return TorchAoConfig(
            ao.Int4WeightOnlyConfig(
                group_size=plan.group_size, int4_packing_format="tile_packed_to_4d"
            )
        )
    return TorchAoConfig(
        ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=ao.PerGroup(plan.group_size))
    )


# ---- export ---------------------------------------------------------------------------------


def export(source: ExportSource, out: Path, cfg: ExportConfig) -> dict:
    """Quantize `source` into `out`, check the folder read back, and return a report; raise
    ExportCheckError when the check fails."""
    if cfg.quant.quant_method in CALIBRATED_BITS:
        return _calibrated().export_calibrated(source, out, cfg)
    silence_quantization_noise()
    plan = plan_export(cfg, source.model_path)  # reads the config only: fails fast
    tokenizer = load_tokenizer(source.tokenizer_path)
    ppl_source = source_perplexity(source, tokenizer)
    print(f"Quantizing {source.description}: {plan.label}, on {plan.device}", flush=True)
    started = time.perf_counter()
    _quantize_and_save(source.model_path, out, plan, cfg.quant)
    tokenizer.save_pretrained(out)
    export_seconds = time.perf_counter() - started
    measured = check_folder_read_back(out, plan.device, ppl_source, plan.bits, PPL_FIX)
    report = {
        "output": str(out),
        "method": plan.method,
        "bits": plan.bits,
        "quantization": plan.label,
        "ppl_source": ppl_source,
        **measured,
        "export_seconds": export_seconds,
        "bytes": folder_bytes(out),
    }
    print(
        f"{plan.label} model saved to {out} ({report['bytes'] / 2**20:.1f} MiB, quantized and "
        f"saved in {export_seconds:.1f} s)"
    )
    return report


def _quantize_and_save(model_path: str, out: Path, plan: QuantPlan, q: QuantArguments) -> None:
    """Load the source quantized on the way in, and save it. Nothing runs the model before
    it is saved: bitsandbytes (0.50) repacks 4-bit weights for its CPU inference kernel on
    the first forward pass and does not restore the scales when saving them afterwards."""
    model = load_model(
        model_path, plan.dtype, plan.device, quantization=transformers_quantization(plan, q)
    )
    try:
        _require_all_quantized(model, plan)
        model.save_pretrained(out)
    finally:
        del model
        gc.collect()


def _require_all_quantized(model, plan: QuantPlan) -> None:
    """Every Linear layer but the output head must come out quantized: a quantizer that
    skips a layer (torchao's CUDA int4 does, for a width that is not a multiple of the group
    size, and says so at INFO level only) would leave a folder that is not what was asked."""
    head = model.get_output_embeddings()
    plain = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and module is not head
        and type(module.weight) in (torch.Tensor, torch.nn.Parameter)
    ]
    if plain:
        raise ExportCheckError(
            f"{plan.label} left {len(plain)} linear layers unquantized (e.g. {plain[0]}); "
            "nothing was written. Try --quant_method int8 or bnb"
        )
