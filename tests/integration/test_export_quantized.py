"""`swiftlm export --quant_method bnb|int8|int4`: a quantized Hugging Face folder that
transformers loads from the folder alone, checked (answers, perplexity) before returning.

The model is conftest's tiny random Llama at hidden size 128, so that int4's default group
size (128) divides its layers' input widths (128 and 256).
"""

import json
import math

import pytest
import torch

from conftest import build_tokenizer
from quant_bounds import BLOCKS, assert_weights_within_quantization_bound
from quant_bounds import EXPORT_FLAGS as FLAGS
from swiftlm.cli.main import main
from swiftlm.config import ExportConfig, parse_config
from swiftlm.export import run as export_run
from swiftlm.export.checks import CHECK_PROMPTS, MAX_PPL_INCREASE
from swiftlm.export.quantize import int4_group_size

pytest.importorskip("bitsandbytes", reason="needs the quant extra: pip install swiftlm[quant]")
pytest.importorskip("torchao", reason="needs the quant extra: pip install swiftlm[quant]")

# What each format's Linear weights are once read back: the bnb layer, or torchao's tensor.
QUANTIZED_TYPES = {
    "bnb4": "Linear4bit",
    "bnb8": "Linear8bitLt",
    "int8": "Int8Tensor",
    "int4": "IntxUnpackedToInt8Tensor",
}


def export(model_dir, out, *flags) -> dict:
    argv = ["--model", str(model_dir), "--output_dir", str(out), *flags]
    return export_run.run(parse_config(ExportConfig, argv, "swiftlm export"))


def quantized_kind(model) -> str:
    """The class name of the first decoder projection, or of its weight for torchao."""
    projection = model.model.layers[0].mlp.up_proj
    if type(projection) is not torch.nn.Linear:
        return type(projection).__name__
    return type(projection.weight).__name__


@pytest.mark.parametrize("kind", ["bnb4", "bnb8", "int8", "int4"])
def test_quantized_folder_loads_alone_and_generates(kind, wide_tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / kind
    report = export(wide_tiny_model_dir, out, *FLAGS[kind])
    printed = capsys.readouterr().out
    assert "held-out perplexity" in printed and "check prompts answered" in printed
    assert report["output"] == str(out) and report["bits"] == (8 if "8" in kind else 4)
    assert report["bytes"] == sum(f.stat().st_size for f in out.iterdir())
    assert len(report["answers"]) == len(CHECK_PROMPTS) and all(report["answers"])
    assert math.isfinite(report["ppl_source"]) and math.isfinite(report["ppl_quantized"])
    assert report["ppl_quantized"] <= report["ppl_source"] * (1 + MAX_PPL_INCREASE[report["bits"]])
    assert report["load_seconds"] > 0 and report["export_seconds"] > 0
    assert "quantization_config" in json.loads((out / "config.json").read_text())

    # The folder alone, as a user loads it: the quantization config comes from config.json.
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert quantized_kind(model) == QUANTIZED_TYPES[kind]
    # Every quantized layer applies the source's weights within the format's rounding bound
    # (7 projections in each of the 2 decoder layers).
    checked = assert_weights_within_quantization_bound(
        model, wide_tiny_model_dir, kind, BLOCKS.get(kind)
    )
    assert checked == 14
    ids = tokenizer("Question number 3?", return_tensors="pt")["input_ids"]
    generated = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert generated.shape[1] > ids.shape[1]


def test_int4_falls_back_to_a_group_size_that_divides_the_layers(
    tiny_model_dir, wide_tiny_model_dir
):
    # Hidden 64, intermediate 128: the default 128 does not divide the 64-wide inputs.
    assert int4_group_size(str(tiny_model_dir), 128) == 64
    assert int4_group_size(str(wide_tiny_model_dir), 128) == 128
    assert int4_group_size(str(wide_tiny_model_dir), 32) == 32


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--quant_method", "int8", "--quant_bits", "4"], "use --quant_method int4"),
        (["--quant_method", "int4", "--group_size", "100"], "--group_size 32, 64 or 128"),
        (["--quant_method", "bnb", "--quant_bits", "3"], "pass --quant_bits 4 or 8"),
        (["--quant_method", "int8", "--to_gguf", "true"], "export one format per command"),
    ],
)
def test_bad_flag_combinations_fail_before_loading(
    wide_tiny_model_dir, tmp_path, capsys, flags, message
):
    argv = [
        "export",
        "--model",
        str(wide_tiny_model_dir),
        "--output_dir",
        str(tmp_path / "out"),
        *flags,
    ]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_int4_without_a_fitting_group_size_names_the_alternatives(tmp_path, capsys):
    from transformers import LlamaConfig

    # Input widths 48 and 80: no group size of 32, 64, 128 divides them. Only the config is
    # read, so there are no weights to write.
    folder = tmp_path / "odd"
    LlamaConfig(
        hidden_size=48, intermediate_size=80, num_hidden_layers=1, num_attention_heads=4
    ).save_pretrained(folder)
    build_tokenizer(folder)
    argv = ["export", "--model", str(folder), "--quant_method", "int4"]
    assert main([*argv, "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "(48, 80)" in err and "use --quant_method int8 or --quant_method bnb" in err


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bnb4", "bnb8", "int8", "int4"])
def test_default_model_exports_answer_and_keep_their_perplexity(kind, tmp_path):
    # SmolLM2-135M-Instruct, ~20 s each on 2 CPU cores. Measured (source 17.93): bnb4 26.31,
    # bnb8 18.14, int8 18.01, int4 (group 64) 29.88.
    argv = ["--output_dir", str(tmp_path / kind), *FLAGS[kind]]
    report = export_run.run(parse_config(ExportConfig, argv, "swiftlm export"))
    assert "Paris" in report["answers"][1]
    assert report["ppl_quantized"] < report["ppl_source"] * (1.1 if report["bits"] == 8 else 2.0)
