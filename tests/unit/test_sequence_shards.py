"""Sequence shards (distributed/sequence_parallel.py): each token held once, each label a
target once, the look-ahead masked; the refusals of --sequence_parallel_size."""

import pytest
import torch

from swiftlm.config import RLHFConfig, TrainConfig, parse_config
from swiftlm.config.checks import Facts
from swiftlm.config.rules import failures
from swiftlm.data.encode import IGNORE_INDEX
from swiftlm.distributed.sequence_parallel import (
    apply_sequence_parallel,
    resolve_impl,
    shard_sequence,
)
from swiftlm.errors import ConfigError
from swiftlm.losses.causal_lm import shifted_labels

PADS = {"input_ids": 0, "labels": IGNORE_INDEX, "attention_mask": 0, "token_mask": 0}


def _batch(width: int = 11):
    ids = torch.arange(1, 2 * width + 1).reshape(2, width)
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX  # a prompt
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("size", [2, 3, 4])
def test_shards_hold_every_token_once_and_every_label_as_one_target(size):
    batch = _batch()
    shards = [shard_sequence(batch, rank, size, PADS) for rank in range(size)]
    length = -(-11 // size)
    own = torch.cat([s["input_ids"][:, :-1] for s in shards], dim=1)[:, :11]
    assert torch.equal(own, batch["input_ids"])  # the shards, look-aheads left out, are the rows
    for rank, shard in enumerate(shards[:-1]):  # the look-ahead is the next shard's first token
        assert torch.equal(shard["input_ids"][:, -1], shards[rank + 1]["input_ids"][:, 0])
    assert all(s["input_ids"].shape[1] == length + 1 for s in shards)
    assert all((s["attention_mask"][:, -1] == 0).all() for s in shards)
    positions = torch.cat([s["position_ids"][:, :-1] for s in shards], dim=1)
    assert torch.equal(positions, torch.arange(size * length).expand(2, -1))
    targets = sum(int((shifted_labels(s["labels"]) != IGNORE_INDEX).sum()) for s in shards)
    assert targets == int((shifted_labels(batch["labels"]) != IGNORE_INDEX).sum())
    tokens = sum(int(s["attention_mask"].sum()) for s in shards)
    assert tokens == batch["attention_mask"].numel()


def test_a_column_without_a_known_padding_is_refused():
    batch = {**_batch(), "loss_weights": torch.ones(2, 11)}
    with pytest.raises(ConfigError, match="`loss_weights` column has no known padding"):
        shard_sequence(batch, 0, 2, PADS)


class _Mesh:  # what apply_sequence_parallel reads of a DeviceMesh
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def get_group(self):
        return None


def test_ulysses_refuses_heads_that_do_not_divide_and_auto_takes_the_ring():
    from conftest import make_tiny_llama

    model = make_tiny_llama(96)  # 4 heads, 2 key/value heads
    with pytest.raises(ConfigError, match="4 attention heads and 2 key/value heads"):
        apply_sequence_parallel(model, _Mesh(4), "ulysses")
    assert resolve_impl("auto", model.config, 4) == "ring"
    assert resolve_impl("auto", model.config, 2) == "ulysses"
    assert resolve_impl("ring", model.config, 2) == "ring"
    model.config.sliding_window = 16  # Mistral-style: only the ring applies the window
    assert resolve_impl("auto", model.config, 2) == "ring"


def _broken(argv: list[str], world_size: int, command=TrainConfig) -> list[str]:
    cfg = parse_config(command, argv, "swiftlm sft")
    return [name for name, _ in failures(cfg, Facts(world_size=world_size))]


def test_sequence_parallel_rules():
    assert "sequence_parallel_divides_world" in _broken(["--sequence_parallel_size", "2"], 3)
    assert _broken(["--sequence_parallel_size", "2"], 4) == []
    tp = ["--sequence_parallel_size", "2", "--tensor_parallel_size", "2"]
    assert _broken(tp, 4) == []
    pp = ["--sequence_parallel_size", "2", "--pipeline_parallel_size", "2"]
    assert "sequence_parallel_alone" in _broken(pp, 4)
    for method in ("grpo", "rm"):
        rlhf = _broken(["--sequence_parallel_size", "2", "--rlhf_type", method], 2, RLHFConfig)
        assert "sequence_parallel_for_token_losses" in rlhf, method
    for method in ("dpo", "kto", "simpo"):
        rlhf = _broken(["--sequence_parallel_size", "2", "--rlhf_type", method], 2, RLHFConfig)
        assert "sequence_parallel_for_token_losses" not in rlhf, method


def test_generation_during_training_is_refused_under_sequence_parallel():
    """Rank 0 alone cannot generate: every attention layer waits on the group's all-to-all."""
    from types import SimpleNamespace

    from swiftlm.distributed.mesh import ParallelDims
    from swiftlm.train.evaluation import whole_model_on_each_rank

    assert whole_model_on_each_rank(SimpleNamespace(dims=ParallelDims(dp=2)))
    assert not whole_model_on_each_rank(SimpleNamespace(dims=ParallelDims(sp=2)))
