"""GPU paths: run with `pytest -m gpu` on a machine with CUDA."""

import json

import pytest
import torch

from swiftlm.cli.main import main

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_lora_trains_on_cuda_with_autocast(tiny_model_dir, chat_jsonl, tmp_path, dtype):
    out = tmp_path / dtype
    argv = [
        "sft",
        "--model",
        str(tiny_model_dir),
        "--dataset",
        str(chat_jsonl),
        "--output_dir",
        str(out),
        "--device",
        "cuda",
        "--torch_dtype",
        dtype,
        "--num_train_epochs",
        "10",
        "--learning_rate",
        "5e-3",
        "--per_device_train_batch_size",
        "4",
        "--logging_steps",
        "1",
        "--report_to",
        "none",
    ]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < 0.6 * losses[0]
