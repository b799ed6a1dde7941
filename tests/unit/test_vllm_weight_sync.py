"""The weight sync of `swiftlm rollout` without vLLM: buckets, the byte packing, and a push
over a real gloo group to a second process playing vLLM's worker (`WeightSyncExtension`
with a `reload_weights` that records what it was given). What arrives must be the sent
tensors bit for bit: the bytes are copied, never converted."""

import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from swiftlm.engine.vllm_weight_sync import (
    TensorSpec,
    TrainerSide,
    bucket_specs,
    buckets,
    flat_bytes,
    split_bytes,
)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(50, 16, generator=g).to(torch.bfloat16),
        "layers.0.q_proj.weight": torch.randn(16, 16, generator=g),
        "layers.0.norm.weight": torch.randn(16, generator=g).to(torch.float16),
        "layers.0.mlp.down_proj.weight": torch.randn(16, 40, generator=g).t(),  # not contiguous
        "odd.weight": torch.randn(3, generator=g).to(torch.float16),  # 6 bytes: misaligns
        "scale": torch.tensor(3.5),
    }


def test_buckets_keep_order_and_respect_the_limit():
    state = _state()
    cut = buckets(state, limit=2000)
    assert [name for bucket in cut for name in bucket] == list(state)
    for bucket in cut:
        size = sum(state[n].numel() * state[n].element_size() for n in bucket)
        assert size <= 2000 or len(bucket) == 1  # a bigger tensor goes alone
    assert len(cut) > 1 and len(buckets(state)) == 1


def test_packing_round_trips_every_dtype_and_layout():
    state = _state()
    specs = [
        TensorSpec(s["name"], tuple(s["shape"]), s["dtype"])
        for s in bucket_specs(state, list(state))
    ]
    back = dict(split_bytes(flat_bytes(list(state.values()), torch.device("cpu")), specs))
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert torch.equal(back[name], tensor)
    with pytest.raises(ValueError, match="bytes received"):
        split_bytes(torch.zeros(3, dtype=torch.uint8), specs)


WORKER = """
import sys, torch
from swiftlm.engine.vllm_weight_sync import WeightSyncExtension

class Worker(WeightSyncExtension):
    rank, device = 0, torch.device("cpu")
    def reload_weights(self, weights_iterator):
        self.got = {name: tensor.clone() for name, tensor in weights_iterator}

port, out, specs = int(sys.argv[1]), sys.argv[2], eval(sys.argv[3])
worker = Worker()
worker.init_weight_sync("127.0.0.1", port, 1, "gloo", 60)
count = worker.receive_weights(specs)
worker.close_weight_sync()
torch.save({"count": count, **worker.got}, out)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_push_reaches_the_worker_bit_for_bit(tmp_path):
    state = _state()
    cut = buckets(state, limit=2000)
    specs = [bucket_specs(state, names) for names in cut]
    port, out = _free_port(), tmp_path / "got.pt"
    worker = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WORKER), str(port), str(out), repr(specs)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        trainer = TrainerSide("127.0.0.1", port, workers=1, backend="gloo", timeout_s=60)
        for names in cut:
            trainer.push(state, names)
        trainer.close()
        _, errors = worker.communicate(timeout=60)
        assert worker.returncode == 0, errors
    finally:
        worker.kill()
    got = torch.load(out)
    assert got.pop("count") == len(state) and list(got) == list(state)
    for name, tensor in state.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)
