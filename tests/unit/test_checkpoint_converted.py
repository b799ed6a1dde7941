"""A full mixture-of-experts checkpoint, which transformers saves one tensor per expert, loads
back into the live model's stacked experts (checkpoint/converted.py): the resume of full
fine-tuning of an MoE model in one process, DDP or expert parallel."""

import pytest
import torch

from conftest import make_tiny_moe
from swiftlm.checkpoint.tensors import load_model_weights, read_weights


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_per_expert_files_load_into_stacked_experts(model_type, tmp_path):
    saved = make_tiny_moe(model_type, 64, seed=0)
    saved.save_pretrained(tmp_path)
    assert not any(name.endswith("experts.gate_up_proj") for name in read_weights(tmp_path))
    live = make_tiny_moe(model_type, 64, seed=1)
    load_model_weights(tmp_path, live)
    for name, tensor in saved.state_dict().items():
        assert torch.equal(live.state_dict()[name], tensor), name
