"""GPU paths: run with `pytest -m gpu` on a machine with CUDA."""

import pytest
import torch

from conftest import logged, tiny_sft
from swiftlm.cli.main import main

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_lora_trains_on_cuda_with_autocast(tiny_model_dir, chat_jsonl, tmp_path, dtype):
    out = tmp_path / dtype
    run = dict(device="cuda", torch_dtype=dtype, num_train_epochs=10, learning_rate="5e-3")
    assert (
        main(tiny_sft(tiny_model_dir, chat_jsonl, out, per_device_train_batch_size=4, **run)) == 0
    )
    losses = logged(out)
    assert losses[-1] < 0.6 * losses[0]
