"""The config sections of the model a command loads (`ModelArguments`: which model, dtype,
device, attention) and of quantized weights (`QuantArguments`: the QLoRA base when training,
the format when exporting). Same conventions as `config/sections.py`: field names are the
flag names, each field's `help` is its `--help` text, each section checks its own fields.
"""

from dataclasses import dataclass
from typing import Literal

from swiftlm.config.checks import check_fields, custom
from swiftlm.config.sections import doc


@dataclass
class ModelArguments:
    model: str | None = doc(
        "Model to load: a local Hugging Face folder, a hub id, or a .gguf file (converted once "
        "into a cached Hugging Face folder). Default: the packaged SmolLM2-135M-Instruct.",
        default=None,
    )
    torch_dtype: Literal["auto", "bfloat16", "float16", "float32"] = doc(
        "Compute dtype. auto = bfloat16 on CUDA with bf16 or a CPU with native bf16 matmul, "
        "else float32. Trainable weights stay float32; compute runs under autocast.",
        default="auto",
    )
    device: Literal["auto", "cpu", "cuda", "mps"] = doc(
        "Device. auto picks cuda > mps > cpu.", default="auto"
    )
    attn_impl: Literal["sdpa", "eager"] = doc("Attention implementation.", default="sdpa")
    experts_impl: Literal["grouped_mm", "batched_mm", "eager"] = doc(
        "Mixture-of-experts models: how the experts run (transformers' implementations). "
        "grouped_mm sorts tokens by expert and runs one grouped GEMM; batched_mm gathers each "
        "token's expert weights (memory grows with tokens); eager loops over experts.",
        default="grouped_mm",
    )
    model_name: str = doc(
        "Name the built-in self-cognition data teaches the model (fills {{NAME}}).",
        default="Swifty",
    )
    model_author: str = doc(
        "Maker the built-in self-cognition data teaches the model (fills {{AUTHOR}}).",
        default="the swiftlm team",
    )


@dataclass
class QuantArguments:
    quant_method: Literal["bnb", "int8", "int4", "gptq", "awq"] | None = doc(
        "Weight quantization. Training (sft/pt): bnb loads the frozen base in 4 or 8 bits "
        "(QLoRA). Export: bnb (bitsandbytes 4/8-bit), int8 (torchao int8 weight-only), "
        "int4 (torchao int4 weight-only; on CPU stored one byte per weight), gptq or awq "
        "(GPT-QModel, calibrated on --dataset; CPU or CUDA).",
        default=None,
    )
    quant_bits: int | None = doc(
        "Bits per weight for --quant_method: 4 or 8 (bnb and gptq, default 4); int8 implies 8, "
        "int4 and awq imply 4.",
        default=None,
    )
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = doc(
        "4-bit bitsandbytes data type: NF4 (QLoRA's) or FP4.", default="nf4"
    )
    bnb_4bit_use_double_quant: bool = doc(
        "Quantize the 4-bit quantization constants too (QLoRA's double quantization).",
        default=True,
    )
    group_size: int = doc(
        "Weights sharing one scale in int4/gptq/awq quantization (torchao int4 and AWQ: 32, "
        "64 or 128; int4 falls back to the largest of these that divides every layer's width, "
        "e.g. 64 for SmolLM2's 576).",
        default=128,
    )
    quant_n_samples: int = doc(
        "Calibration samples taken from --dataset for gptq/awq.", default=128
    )

    def __post_init__(self):
        check_fields(
            self,
            group_size=custom(
                lambda v: v == -1 or v >= 1,
                "--{flag} {value}: pass a positive size (e.g. 128) or -1 (per channel)",
            ),
            quant_n_samples=custom(lambda v: v >= 1, "--{flag} must be at least 1, not {value}"),
        )
