"""Quantization flags: what QLoRA training and quantized exports accept, and the errors that
name the fix for what they do not. Nothing here loads a model."""

import logging
import re
import sys
from types import SimpleNamespace

import pytest
import torch

from swiftlm.config import ExportConfig, TrainConfig, parse_config
from swiftlm.config.rules import check
from swiftlm.errors import ConfigError
from swiftlm.export import quantize
from swiftlm.export import run as export_run
from swiftlm.export.quantize import quant_bits, validate
from swiftlm.models.quant import (
    bnb_config,
    describe_bnb,
    import_torchao,
    logical_numel,
    silence_quantization_noise,
)


def train_config(*flags) -> TrainConfig:
    argv = ["--dataset", "data.jsonl", *map(str, flags)]
    return parse_config(TrainConfig, argv, "swiftlm sft")


def export_config(*flags) -> ExportConfig:
    argv = ["--output_dir", "out", "--device", "cpu", *map(str, flags)]
    return parse_config(ExportConfig, argv, "swiftlm export")


# ---- training -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        ["--quant_method", "bnb"],
        ["--quant_method", "bnb", "--quant_bits", 4, "--train_type", "dora"],
        ["--quant_method", "bnb", "--quant_bits", 8],
        ["--quant_method", "bnb", "--nproc_per_node", 2],  # DDP
        ["--quant_method", "bnb", "--nproc_per_node", 2, "--fsdp", "fsdp2"],
        ["--quant_method", "bnb", "--torch_compile", "true", "--gradient_checkpointing", "true"],
    ],
)
def test_qlora_combinations_that_train(flags):
    check(train_config(*flags))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--quant_method", "int8"], "use --quant_method bnb"),
        (["--quant_method", "gptq"], "`swiftlm export` formats"),
        (["--quant_method", "bnb", "--quant_bits", 3], "pass --quant_bits 4 or 8"),
        (["--quant_method", "bnb", "--train_type", "full"], "use --train_type lora or dora"),
        (["--quant_bits", 4], "add --quant_method bnb"),
        (["--quant_method", "bnb", "--deepspeed", "zero2"], "cannot be resumed"),
        (["--quant_method", "bnb", "--tensor_parallel_size", 2], "DTensor shards"),
        (["--quant_method", "bnb", "--pipeline_parallel_size", 2], "inside pipeline stages"),
    ],
)
def test_qlora_errors_name_the_fix(flags, message):
    with pytest.raises(ConfigError, match=message):
        check(train_config(*flags))


def test_bnb_config_follows_the_flags():
    cfg = train_config("--quant_method", "bnb")
    four = bnb_config(cfg.quant, torch.bfloat16)
    assert four.load_in_4bit and four.bnb_4bit_quant_type == "nf4"
    assert four.bnb_4bit_use_double_quant and four.bnb_4bit_compute_dtype == torch.bfloat16
    assert describe_bnb(cfg.quant) == "bitsandbytes 4-bit nf4, double quantization"
    flags = ["--quant_method", "bnb", "--bnb_4bit_quant_type", "fp4"]
    fp4 = train_config(*flags, "--bnb_4bit_use_double_quant", "false").quant
    assert bnb_config(fp4, torch.float32).bnb_4bit_quant_type == "fp4"
    assert not bnb_config(fp4, torch.float32).bnb_4bit_use_double_quant
    eight = train_config("--quant_method", "bnb", "--quant_bits", 8).quant
    assert bnb_config(eight, torch.float32).load_in_8bit
    assert describe_bnb(eight) == "bitsandbytes 8-bit (LLM.int8)"


def test_missing_libraries_name_the_flag_and_the_install(monkeypatch):
    # A None entry in sys.modules makes `import` raise ImportError, as if not installed.
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    hint = re.escape("install it with `pip install 'swiftlm[quant]'`")
    with pytest.raises(ConfigError, match=f"--quant_method bnb needs the `bitsandbytes`.*{hint}"):
        bnb_config(train_config("--quant_method", "bnb").quant, torch.float32)
    with pytest.raises(ConfigError, match=f"--quant_method int8 needs the `torchao`.*{hint}"):
        import_torchao("--quant_method int8")


def test_packed_4bit_weights_count_as_the_weights_they_stand_for():
    packed = torch.zeros(16, 1, dtype=torch.uint8)  # 32 4-bit weights, two per byte
    packed.quant_state = SimpleNamespace(shape=torch.Size([4, 8]))
    assert logical_numel(packed) == 32
    assert logical_numel(torch.zeros(3, 5)) == 15


def test_library_noise_is_dropped_and_other_records_kept(caplog):
    silence_quantization_noise()
    silence_quantization_noise()  # idempotent: one filter per logger
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING):
        logger.warning("MatMul8bitLt: inputs will be cast from %s to float16", torch.float32)
        logger.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


# ---- export ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "bits"),
    [
        (["--quant_method", "bnb"], 4),
        (["--quant_method", "bnb", "--quant_bits", 8], 8),
        (["--quant_method", "int8"], 8),
        (["--quant_method", "int8", "--quant_bits", 8], 8),
        (["--quant_method", "int4", "--group_size", 32], 4),
    ],
)
def test_export_bits_follow_the_method(flags, bits):
    cfg = export_config(*flags)
    check(cfg)
    validate(cfg)
    assert quant_bits(cfg.quant) == bits


# Every export rule's message is tested in test_config_rules.py; here, that the export
# command runs the rules before anything else.
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--quant_method", "int8", "--quant_bits", 4], "use --quant_method int4"),
        (["--quant_method", "int8", "--bnb_4bit_quant_type", "fp4"], "bnb --quant_bits 4 only"),
    ],
)
def test_export_flag_errors_name_the_fix(flags, message, monkeypatch):
    # The rules (`config/rules.py`) run first: the quantize module is never reached.
    monkeypatch.setattr(quantize, "validate", None)  # fails if reached
    with pytest.raises(ConfigError, match=message):
        export_run.run(export_config(*flags))
