"""`swiftlm export --quant_method gptq|awq`: calibrated on --dataset, read back by transformers.

The quantizing tests need the optional `gptqmodel` (and `optimum` for GPTQ's loader) and are
skipped without them; the error tests run everywhere. They quantize conftest's wider tiny
Llama (hidden 128, MLP 256), so every layer width is a multiple of the default group size 128,
as the int4 kernels require.
"""

import json

import pytest
import torch

from swiftlm.cli.main import main


@pytest.fixture(scope="module")
def wide_tiny_model_dir(tmp_path_factory):
    """conftest's hidden-128 Llama at transformers' default initialisation (0.02), whose
    outputs the perplexity margins were measured on."""
    from tests.conftest import build_wide_tiny_llama

    return build_wide_tiny_llama(tmp_path_factory.mktemp("tiny-llama-128"), 0.02)


@pytest.fixture
def fast_gptqmodel(monkeypatch):
    """gptqmodel without its C++ packing extension: compiling it takes over a minute on first
    use, while the Python packer it falls back to takes milliseconds on a tiny model."""
    pytest.importorskip("gptqmodel")
    monkeypatch.setenv("GPTQMODEL_DISABLE_PACK_EXT", "1")


def _export(model_dir, data, out, method, *flags):
    """Export with 8 calibration samples, unless `flags` give --quant_n_samples."""
    argv = ["export", "--model", str(model_dir), "--quant_method", method, "--dataset", str(data)]
    samples = [] if "--quant_n_samples" in flags else ["--quant_n_samples", "8"]
    return main([*argv, *samples, "--output_dir", str(out), *flags])


def _load_and_generate(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu")
    ids = tokenizer("Question number 3?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return model, generated[0, ids.shape[1] :]


def test_gptq_export_loads_back_and_generates(
    fast_gptqmodel, wide_tiny_model_dir, chat_jsonl, tmp_path, capsys
):
    pytest.importorskip("optimum")
    out = tmp_path / "gptq"
    assert _export(wide_tiny_model_dir, chat_jsonl, out, "gptq", "--quant_bits", "4") == 0
    printed = capsys.readouterr().out
    assert "on 8 samples from" in printed and str(chat_jsonl) in printed
    assert "5/5 check prompts answered" in printed and "held-out perplexity" in printed
    quantization = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quantization["quant_method"] == "gptq" and quantization["bits"] == 4
    assert quantization["group_size"] == 128
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()
    model, new_tokens = _load_and_generate(out)
    assert len(new_tokens) == 4
    layer = model.model.layers[0].self_attn.q_proj
    assert not isinstance(layer, torch.nn.Linear)  # a quantized kernel, not float weights


def test_awq_export_loads_back(fast_gptqmodel, wide_tiny_model_dir, chat_jsonl, tmp_path, capsys):
    out = tmp_path / "awq"
    assert _export(wide_tiny_model_dir, chat_jsonl, out, "awq", "--group_size", "64") == 0
    assert "5/5 check prompts answered" in capsys.readouterr().out
    quantization = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quantization["quant_method"] == "awq" and quantization["group_size"] == 64
    _, new_tokens = _load_and_generate(out)
    assert len(new_tokens) == 4


def test_missing_library_names_the_install_command(
    tiny_model_dir, chat_jsonl, tmp_path, capsys, monkeypatch
):
    from swiftlm.export import calibrated

    monkeypatch.setattr(calibrated, "_installed", lambda name: name != "gptqmodel")
    assert _export(tiny_model_dir, chat_jsonl, tmp_path / "out", "gptq") == 2
    error = capsys.readouterr().err
    assert "needs gptqmodel" in error and "pip install 'swiftlm[gptq]'" in error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--quant_bits", "3"], "takes --quant_bits 4 or 8, not 3"),
        (["--quant_n_samples", "0"], "--quant_n_samples must be at least 1"),
    ],
)
def test_bad_flags_fail_before_loading(
    tiny_model_dir, chat_jsonl, tmp_path, capsys, monkeypatch, flags, message
):
    from swiftlm.export import calibrated

    monkeypatch.setattr(calibrated, "_installed", lambda name: True)
    assert _export(tiny_model_dir, chat_jsonl, tmp_path / "out", "gptq", *flags) == 2
    assert message in capsys.readouterr().err


def test_awq_rejects_8_bits(tiny_model_dir, chat_jsonl, tmp_path, capsys, monkeypatch):
    from swiftlm.export import calibrated

    monkeypatch.setattr(calibrated, "_installed", lambda name: True)
    assert _export(tiny_model_dir, chat_jsonl, tmp_path / "o", "awq", "--quant_bits", "8") == 2
    assert "takes --quant_bits 4, not 8" in capsys.readouterr().err


def test_group_size_must_divide_layer_widths(
    wide_tiny_model_dir, chat_jsonl, tmp_path, capsys, monkeypatch
):
    from swiftlm.export import calibrated

    monkeypatch.setattr(calibrated, "_installed", lambda name: True)
    argv = (wide_tiny_model_dir, chat_jsonl, tmp_path / "o", "gptq", "--group_size", "48")
    assert _export(*argv) == 2
    error = capsys.readouterr().err
    assert "--group_size 48 does not divide" in error and "(128, 256)" in error
    assert "pass --group_size 128" in error


@pytest.mark.slow
def test_default_model_gptq_4bit_within_the_perplexity_margin(tmp_path, capsys):
    """SmolLM2-135M-Instruct (widths 576 and 1536, so group size 64), built-in calibration
    data: about 2.5 minutes on 2 CPU cores."""
    pytest.importorskip("gptqmodel")
    pytest.importorskip("optimum")
    out = tmp_path / "gptq4"
    argv = ["export", "--quant_method", "gptq", "--group_size", "64"]
    assert main([*argv, "--quant_n_samples", "32", "--output_dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "(built-in; pass --dataset for your own)" in printed
    assert "5/5 check prompts answered" in printed
    assert sum(f.stat().st_size for f in out.iterdir()) < 150 * 2**20  # float32: 540 MB
