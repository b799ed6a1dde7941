"""Quantization on CUDA: QLoRA training, bnb/torchao exports, GPTQ/AWQ. Run with `pytest -m gpu`
on a machine with CUDA (and `pip install 'swiftlm[gptq]'` for the GPTQ/AWQ tests)."""

import math

import pytest
import torch

from conftest import CHAT_ROWS, logged, tiny_sft, write_jsonl
from quant_bounds import BLOCKS, assert_weights_within_quantization_bound
from quant_bounds import EXPORT_FLAGS as FLAGS
from swiftlm.cli.main import main
from swiftlm.config import ExportConfig, parse_config
from swiftlm.export import run as export_run
from swiftlm.export.checks import MAX_PPL_INCREASE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
pytest.importorskip("bitsandbytes", reason="needs the quant extra: pip install swiftlm[quant]")


def export_on_cuda(model_dir, out, *flags) -> dict:
    """`swiftlm export --device cuda`, returning its report (raises if its check fails)."""
    argv = ["--model", str(model_dir), "--device", "cuda", "--output_dir", str(out), *flags]
    return export_run.run(parse_config(ExportConfig, argv, "swiftlm export"))


def assert_perplexity_kept(report: dict) -> None:
    """The export's read-back check, as numbers: the folder's held-out perplexity at most
    MAX_PPL_INCREASE[bits] above the float32 source's (as tests/integration/
    test_export_quantized.py asserts on CPU)."""
    assert math.isfinite(report["ppl_source"]) and math.isfinite(report["ppl_quantized"])
    limit = report["ppl_source"] * (1 + MAX_PPL_INCREASE[report["bits"]])
    assert report["ppl_quantized"] <= limit, report


@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_trains_on_cuda(tiny_model_dir, tmp_path, bits):
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    run = dict(device="cuda", quant_method="bnb", quant_bits=bits, max_steps=20)
    flags = dict(run, learning_rate="5e-3", lora_dropout=0, per_device_train_batch_size=4)
    assert main(tiny_sft(tiny_model_dir, data, tmp_path / "run", **flags)) == 0
    losses = logged(tmp_path / "run")
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses


@pytest.mark.parametrize("kind", sorted(FLAGS))
def test_quantized_exports_on_cuda_load_back_and_generate(wide_tiny_model_dir, tmp_path, kind):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    report = export_on_cuda(wide_tiny_model_dir, out, *FLAGS[kind])
    assert report["bits"] == (8 if "8" in kind else 4)
    assert_perplexity_kept(report)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cuda")
    # The CUDA kernels apply the source's weights within the format's rounding bound (7
    # projections in each of the 2 decoder layers; tests/quant_bounds.py derives the bound).
    checked = assert_weights_within_quantization_bound(
        model, wide_tiny_model_dir, kind, BLOCKS.get(kind)
    )
    assert checked == 14
    ids = tokenizer("Question number 3?", return_tensors="pt")["input_ids"].cuda()
    generated = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert generated.shape[1] > ids.shape[1]


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_exports_on_cuda(wide_tiny_model_dir, tmp_path, method):
    pytest.importorskip("gptqmodel", reason="needs the gptq extra: pip install swiftlm[gptq]")
    from transformers import AutoModelForCausalLM

    data = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    out = tmp_path / method
    flags = ["--quant_method", method, "--quant_n_samples", "16", "--dataset", str(data)]
    report = export_on_cuda(wide_tiny_model_dir, out, *flags)
    # GPTQ and AWQ move weights to compensate each other's rounding, so no per-weight bound
    # holds: the model is held to the source by its perplexity.
    assert report["bits"] == 4
    assert_perplexity_kept(report)
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cuda")
    assert type(model.model.layers[0].mlp.up_proj) is not torch.nn.Linear
