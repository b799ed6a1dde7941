"""Quantization on CUDA: QLoRA training, bnb/torchao exports, GPTQ/AWQ. Run with `pytest -m gpu`
on a machine with CUDA (and `pip install 'swiftlm[gptq]'` for the GPTQ/AWQ tests)."""

import pytest
import torch

from conftest import CHAT_ROWS, logged, tiny_sft, write_jsonl
from swiftlm.cli.main import main

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
pytest.importorskip("bitsandbytes", reason="needs the quant extra: pip install swiftlm[quant]")


@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_trains_on_cuda(tiny_model_dir, tmp_path, bits):
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    run = dict(device="cuda", quant_method="bnb", quant_bits=bits, max_steps=20)
    flags = dict(run, learning_rate="5e-3", lora_dropout=0, per_device_train_batch_size=4)
    assert main(tiny_sft(tiny_model_dir, data, tmp_path / "run", **flags)) == 0
    losses = logged(tmp_path / "run")
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses


@pytest.mark.parametrize(
    "flags",
    [
        ["--quant_method", "bnb", "--quant_bits", "4"],
        ["--quant_method", "bnb", "--quant_bits", "8"],
        ["--quant_method", "int8"],
        ["--quant_method", "int4"],
    ],
    ids=["bnb4", "bnb8", "int8", "int4"],
)
def test_quantized_exports_on_cuda_load_back_and_generate(wide_tiny_model_dir, tmp_path, flags):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    argv = ["export", "--model", str(wide_tiny_model_dir), "--device", "cuda", *flags]
    assert main([*argv, "--output_dir", str(out)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cuda")
    ids = tokenizer("Question number 3?", return_tensors="pt")["input_ids"].cuda()
    generated = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert generated.shape[1] > ids.shape[1]


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_exports_on_cuda(wide_tiny_model_dir, tmp_path, method):
    pytest.importorskip("gptqmodel", reason="needs the gptq extra: pip install swiftlm[gptq]")
    from transformers import AutoModelForCausalLM

    data = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    out = tmp_path / method
    argv = [
        "export",
        "--model",
        str(wide_tiny_model_dir),
        "--device",
        "cuda",
        "--quant_method",
        method,
    ]
    argv += ["--quant_n_samples", "16", "--dataset", str(data), "--output_dir", str(out)]
    assert main(argv) == 0
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cuda")
    assert type(model.model.layers[0].mlp.up_proj) is not torch.nn.Linear
