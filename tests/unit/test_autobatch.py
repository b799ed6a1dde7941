"""`--per_device_train_batch_size auto` on CPU: a plan from the model's shapes and free memory."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from swiftlm.config import TrainConfig
from swiftlm.config.parse import parse_config
from swiftlm.train import autobatch


def _model(layers=2, hidden=64):
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
    )
    return LlamaForCausalLM(config)


def test_activation_estimate_follows_the_shapes():
    config = _model(layers=2, hidden=64).config
    bf16 = autobatch.activation_bytes_per_token(config, torch.bfloat16, checkpointing=False)
    fp32 = autobatch.activation_bytes_per_token(config, torch.float32, checkpointing=False)
    # 2 layers x (2 bytes x (6 x 64 + 4 x 256) + 8 x 64) bytes.
    assert bf16 == 2 * (2 * (6 * 64 + 4 * 256) + 8 * 64)
    assert fp32 > bf16
    deeper = autobatch.activation_bytes_per_token(
        _model(layers=8).config, torch.bfloat16, checkpointing=False
    )
    assert deeper == 4 * bf16
    checkpointed = autobatch.activation_bytes_per_token(
        _model(layers=8).config, torch.bfloat16, checkpointing=True
    )
    assert checkpointed < deeper / 3


def test_planned_batch_grows_with_free_memory_and_shrinks_with_length():
    model = _model()
    plan = lambda free, length: autobatch.planned_cpu_batch(  # noqa: E731
        model, length, torch.float32, False, free
    )
    per_sample = 512 * autobatch.activation_bytes_per_token(model.config, torch.float32, False)
    states = autobatch.training_state_bytes(model)
    free = int((10 * per_sample + states) / autobatch.CPU_MEMORY_SHARE) + 1
    assert plan(free, 512) == 10
    assert plan(free, 1024) == 5
    assert plan(100, 512) == 1  # never below one
    assert plan(10**15, 512) == autobatch.MAX_AUTO_BATCH


@pytest.mark.parametrize(
    "argv",
    [
        ["--per_device_train_batch_size", "auto"],
        ["--per_device_train_batch_size=auto"],
    ],
)
def test_auto_is_parsed_as_zero(argv):
    cfg = parse_config(TrainConfig, argv, "swiftlm sft")
    assert cfg.train.per_device_train_batch_size == 0
