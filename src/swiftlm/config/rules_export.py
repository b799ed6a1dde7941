"""Rules between the flags of `swiftlm export` (part of `rules.RULES`): which formats, which
quantization settings each takes, and the calibration data they need."""

from swiftlm.config.checks import Facts, Rule
from swiftlm.config.commands import ExportConfig
from swiftlm.models.config import QuantArguments

BNB_BITS = (4, 8)

# Shared with the inference and training tables.
BNB_BITS_RULE = Rule(
    "bnb_bits",
    lambda c, f: c.quant.quant_method == "bnb" and c.quant.quant_bits not in (None, *BNB_BITS),
    "--quant_bits {quant_bits} with --quant_method bnb: bitsandbytes stores weights in 4 bits "
    "(NF4/FP4, QLoRA) or 8 bits (LLM.int8); pass --quant_bits 4 or 8",
)

CKPT_DIR_OR_ADAPTERS_RULE = Rule(
    "ckpt_dir_or_adapters",
    lambda c, f: bool(c.infer.ckpt_dir) and bool(c.infer.adapters),
    "--ckpt_dir and --adapters both given: pass the checkpoint as --ckpt_dir, or the "
    "adapter folders as --adapters (with --model for their base model), not both",
)

TORCHAO_BITS = {"int8": 8, "int4": 4}
CALIBRATED_BITS = {"gptq": (4, 8), "awq": (4,)}  # the first is the default
GROUP_SIZES = (32, 64, 128)  # torchao's int4 kernels and AWQ's packed GEMM take these only
# Shorter samples carry too few activations to matter (gptqmodel drops those under 10 too).
MIN_CALIBRATION_TOKENS = 10
FORMAT_FLAGS = {
    "gguf": "--to_gguf",
    "quantized": "--quant_method",
    "onnx": "--to_onnx",
    "merged_models": "--merge_models",
}


def export_formats(c: ExportConfig) -> list[str]:
    """The output formats the flags ask for (--merge_lora alone is none of them)."""
    e = c.export
    asked = {
        "gguf": e.to_gguf or e.to_ollama,
        "quantized": c.quant.quant_method is not None,
        "onnx": e.to_onnx,
        "merged_models": bool(e.merge_models),
    }
    return [name for name, on in asked.items() if on]


def _torchao_bits_message(c: ExportConfig, f: Facts) -> str:
    q, implied = c.quant, TORCHAO_BITS[c.quant.quant_method]
    matching = {8: "int8", 4: "int4"}.get(q.quant_bits)
    fix = "drop --quant_bits" + (f", or use --quant_method {matching}" if matching else "")
    return (
        f"--quant_bits {q.quant_bits} contradicts --quant_method {q.quant_method}, which stores "
        f"{implied}-bit weights; {fix}"
    )


def _calibrated_bits(q: QuantArguments) -> int:
    return CALIBRATED_BITS[q.quant_method][0] if q.quant_bits is None else q.quant_bits


def _bnb_4bit_flags(q: QuantArguments) -> list[str]:
    """The bitsandbytes 4-bit flags given, as `--flag value`."""
    defaults = QuantArguments()
    names = ("bnb_4bit_quant_type", "bnb_4bit_use_double_quant")
    return [f"--{n} {getattr(q, n)}" for n in names if getattr(q, n) != getattr(defaults, n)]


EXPORT_RULES = (
    Rule(
        "one_export_format",
        lambda c, f: len(export_formats(c)) > 1,
        lambda c, f: (
            f"{' and '.join(FORMAT_FLAGS[name] for name in export_formats(c))} both given: "
            "export one format per command, each to its own --output_dir"
        ),
    ),
    Rule(
        "something_to_export",
        lambda c, f: not export_formats(c) and not c.export.merge_lora,
        "nothing to export: pass --merge_lora, --to_gguf (--to_ollama), --quant_method "
        "bnb|int8|int4|gptq|awq, --to_onnx, or --merge_models",
    ),
    Rule(
        "merge_models_over_model",
        lambda c, f: bool(c.export.merge_models) and bool(c.infer.ckpt_dir or c.infer.adapters),
        "--merge_models merges its models over --model (their common base); --ckpt_dir and "
        "--adapters name another model: drop them, and list adapters in --merge_models",
    ),
    Rule(
        "merge_weights_per_model",
        lambda c, f: (
            c.export.merge_weights is not None
            and len(c.export.merge_weights) != len(c.export.merge_models)
        ),
        lambda c, f: (
            f"--merge_weights has {len(c.export.merge_weights)} values for "
            f"{len(c.export.merge_models)} --merge_models: give one weight per model"
        ),
    ),
    Rule(
        "slerp_of_two_models",
        lambda c, f: (
            bool(c.export.merge_models)
            and c.export.merge_method == "slerp"
            and len(c.export.merge_models) != 2
        ),
        lambda c, f: (
            f"--merge_method slerp interpolates between two models, and --merge_models lists "
            f"{len(c.export.merge_models)}: give two (merge more with linear, ties or dare_ties)"
        ),
    ),
    Rule(
        "export_output_dir_given",
        lambda c, f: not c.export.output_dir,
        "--output_dir is required: the folder to write the exported model to",
    ),
    CKPT_DIR_OR_ADAPTERS_RULE,
    BNB_BITS_RULE,
    Rule(
        "torchao_bits",
        lambda c, f: (
            c.quant.quant_method in TORCHAO_BITS
            and c.quant.quant_bits not in (None, TORCHAO_BITS[c.quant.quant_method])
        ),
        _torchao_bits_message,
    ),
    Rule(
        "calibrated_bits",
        lambda c, f: (
            c.quant.quant_method in CALIBRATED_BITS
            and _calibrated_bits(c.quant) not in CALIBRATED_BITS[c.quant.quant_method]
        ),
        lambda c, f: (
            f"--quant_method {c.quant.quant_method} takes --quant_bits "
            f"{' or '.join(map(str, CALIBRATED_BITS[c.quant.quant_method]))}, "
            f"not {_calibrated_bits(c.quant)}"
        ),
    ),
    Rule(
        "bnb_4bit_flags_need_bnb_4bit",
        lambda c, f: (
            c.quant.quant_method in ("bnb", *TORCHAO_BITS)
            and bool(_bnb_4bit_flags(c.quant))
            and not (c.quant.quant_method == "bnb" and c.quant.quant_bits in (None, 4))
        ),
        lambda c, f: (
            f"{' '.join(_bnb_4bit_flags(c.quant))} applies to --quant_method bnb --quant_bits 4 "
            f"only, not to --quant_method {c.quant.quant_method}"
            f"{'' if c.quant.quant_bits is None else f' --quant_bits {c.quant.quant_bits}'}; drop it"
        ),
    ),
    Rule(
        "group_size_needs_grouped_method",
        lambda c, f: (
            c.quant.quant_method in ("bnb", "int8")
            and c.quant.group_size != QuantArguments().group_size
        ),
        "--group_size {group_size} applies to --quant_method int4, gptq and awq, not to "
        "--quant_method {quant_method} (whose scales are per block of 64 weights for bnb "
        "4-bit, per row for 8-bit); drop it",
    ),
    Rule(
        "int4_group_size",
        lambda c, f: c.quant.quant_method == "int4" and c.quant.group_size not in GROUP_SIZES,
        "--group_size {group_size} with --quant_method int4: torchao's int4 kernels take "
        "--group_size 32, 64 or 128",
    ),
    Rule(
        "awq_group_size",
        lambda c, f: c.quant.quant_method == "awq" and c.quant.group_size not in GROUP_SIZES,
        "--quant_method awq takes --group_size 32, 64 or 128, not {group_size}",
    ),
    Rule(
        "calibration_sample_length",
        lambda c, f: (
            c.quant.quant_method in CALIBRATED_BITS and c.data.max_length < MIN_CALIBRATION_TOKENS
        ),
        f"--max_length {{max_length}}: calibration samples need at least "
        f"{MIN_CALIBRATION_TOKENS} tokens",
    ),
    Rule(
        "onnx_float32",
        lambda c, f: c.export.to_onnx and c.model.torch_dtype not in ("auto", "float32"),
        "--torch_dtype {torch_dtype}: --to_onnx writes and checks float32 weights; drop "
        "--torch_dtype (or pass float32)",
    ),
)
