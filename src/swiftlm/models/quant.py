"""Weight quantization shared by training and export.

- bitsandbytes: the frozen 4-bit (NF4/FP4) or 8-bit (LLM.int8) base of QLoRA training
  (`swiftlm sft --quant_method bnb`), and bnb exports;
- torchao: int8 / int4 weight-only exports (see `swiftlm/export/quantize.py`).

Both libraries are optional (`pip install 'swiftlm[quant]'`): they are imported only when a
quantization flag asks for them, through `import_bitsandbytes` / `import_torchao`, which name
the flag and the fix when the library is missing.
"""

import importlib
import logging

import torch

from swiftlm.errors import ConfigError
from swiftlm.models.config import QuantArguments

INSTALL_HINT = "pip install 'swiftlm[quant]'"

# Log records that bitsandbytes, torchao and torch emit about things a user can do nothing
# about; each logger keeps every other record.
NOISY_LOG_RECORDS = {
    # bnb on AVX512-BF16 CPUs: an optional faster kernel from the `kernels` package is absent;
    # bnb's built-in CPU kernel is used instead.
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
    # LLM.int8 quantizes activations through float16 on every call, by design.
    "bitsandbytes.autograd._functions": ("MatMul8bitLt: inputs will be cast",),
    # The torchao wheel ships CUDA-only kernels (mxfp8, cutlass) that fail to load elsewhere.
    "torchao": ("Failed to load ",),
    # torchao registers enums as pytree constants: a deprecation aimed at torchao, not users.
    "torch.utils._pytree": ("is an Enum subclass",),
    # DeepSpeed (imported by transformers' integrations when installed) announces its choice.
    "DeepSpeed": ("Setting accelerator to CPU",),
}


class _DropRecords(logging.Filter):
    """Drops log records whose (unformatted) message contains one of `fragments`."""

    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not any(fragment in message for fragment in self.fragments)


def silence_quantization_noise() -> None:
    """Filter the records of NOISY_LOG_RECORDS out (idempotent). Call it before transformers
    imports torchao (it does when its modeling code loads) to catch the import-time ones."""
    for name, fragments in NOISY_LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropRecords) for f in logger.filters):
            logger.addFilter(_DropRecords(fragments))


def _import_optional(module: str, flag: str):
    silence_quantization_noise()
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"{flag} needs the `{module.split('.')[0]}` package, which could not be imported "
            f"({exc}); install it with `{INSTALL_HINT}`"
        ) from None


def import_bitsandbytes(flag: str = "--quant_method bnb"):
    """The bitsandbytes module, or a ConfigError naming `flag` and the install command."""
    return _import_optional("bitsandbytes", flag)


def import_torchao(flag: str):
    """The torchao.quantization module, or a ConfigError naming `flag` and the fix."""
    return _import_optional("torchao.quantization", flag)


# ---- flags --------------------------------------------------------------------------------


def bnb_bits(quant: QuantArguments) -> int:
    """--quant_bits for bitsandbytes: 4 (QLoRA's NF4) when unset. That it is 4 or 8 is the
    rule `bnb_bits` (`config/rules.py`), which training and export check first."""
    return 4 if quant.quant_bits is None else quant.quant_bits


def describe_bnb(quant: QuantArguments) -> str:
    """One line for the console, e.g. `bitsandbytes 4-bit nf4, double quantization`."""
    if bnb_bits(quant) == 8:
        return "bitsandbytes 8-bit (LLM.int8)"
    double = "double quantization" if quant.bnb_4bit_use_double_quant else "no double quantization"
    return f"bitsandbytes 4-bit {quant.bnb_4bit_quant_type}, {double}"


def bnb_config(quant: QuantArguments, compute_dtype: torch.dtype):
    """transformers' BitsAndBytesConfig for these flags; 4-bit matmuls run in compute_dtype."""
    import_bitsandbytes()
    from transformers import BitsAndBytesConfig

    if bnb_bits(quant) == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=quant.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
    )


# ---- training -----------------------------------------------------------------------------


def prepare_for_quantized_training(model):
    """Get a bitsandbytes-loaded model ready for adapters on top (call before peft).

    peft's `prepare_model_for_kbit_training` is not used: it upcasts every non-quantized
    weight (embeddings, norms, LM head) to float32 and turns gradient checkpointing on
    whatever --gradient_checkpointing says. The training pipeline already keeps frozen
    weights in the compute dtype and runs under autocast, as for plain LoRA (float32 where
    fp16 compute needs it), so the upcast would only cost memory (SmolLM2's tied 49152 x 576
    embedding: +57 MB, on a CPU the same RAM as everything else); checkpointing follows the
    flag, non-reentrant, which needs no input-gradient hook. peft freezes the base itself.

    What is left: bitsandbytes (0.50, AVX512-BF16 CPUs) repacks a Linear4bit's weight for its
    inference kernel on the first eval-mode, no-grad forward (evaluation), and from then on
    also trains through that kernel, which has no backward: the gradient through the frozen
    base matmuls is silently lost. Training therefore keeps the trainable layout.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


# ---- inspection ---------------------------------------------------------------------------


def logical_numel(param: torch.Tensor) -> int:
    """The number of weights a parameter stands for: a bnb 4-bit Params4bit packs two into a
    byte, and its original shape lives in its quantization state."""
    shape = getattr(getattr(param, "quant_state", None), "shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else param.numel()


def quantized_linear_names(model) -> dict[str, str]:
    """{module name: class name} of the bitsandbytes linear layers in `model` (peft's LoRA
    wrappers around them not counted)."""
    bnb = import_bitsandbytes()
    classes = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    return {
        name: type(module).__name__
        for name, module in model.named_modules()
        if isinstance(module, classes)
    }
