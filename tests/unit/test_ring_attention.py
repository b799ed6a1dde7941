"""Ring attention (distributed/ring_attention.py) over gloo ranks equals attention over the
whole sequence, forward and backward: causal, per packed sample, with GQA and a window."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from swiftlm.distributed import ring_attention
from swiftlm.distributed.ring_attention import RingAttention, sample_ids


def _inputs(length: int, size: int, heads: int, kv_heads: int):
    generator = torch.Generator().manual_seed(0)
    total = length * size

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q, k, v = rand(2, heads, total, 8), rand(2, kv_heads, total, 8), rand(2, kv_heads, total, 8)
    # Row 0: one sequence; row 1: three packed samples, the middle one crossing a shard edge.
    cut = [total // 3, total // 3 + total // 2]
    second = torch.cat([torch.arange(cut[0]), torch.arange(cut[1] - cut[0])])
    second = torch.cat([second, torch.arange(total - cut[1])])
    positions = torch.stack([torch.arange(total), second])
    return q, k, v, positions, rand(2, heads, total, 8)


def _reference(q, k, v, positions, window, scale):
    """Attention over the whole sequence with an explicit mask, in float64."""
    samples = sample_ids(positions)
    index = torch.arange(q.shape[2])
    visible = (index[None, :] <= index[:, None]) & (
        samples[:, None, :, None] == samples[:, None, None, :]
    )
    if window:
        visible &= index[:, None] - index[None, :] < window
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _worker(rank, size, folder, heads, kv_heads, window, length, results):
    ring_attention.SCORE_ELEMENTS = 2 * heads * length * 64  # chunks of 64 query rows
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=size
    )
    q, k, v, positions, grad = _inputs(length, size, heads, kv_heads)
    mine = slice(rank * length, (rank + 1) * length)
    # Views of a longer row, as the model passes them (its look-ahead cut off).
    shard = [t.float()[:, :, mine].requires_grad_() for t in (q, k, v)]
    out = RingAttention.apply(*shard, sample_ids(positions), dist.group.WORLD, 0.3, window)
    out.backward(grad[:, :, mine].float())
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = _reference(*full, positions, window, 0.3)
    expected.backward(grad)
    errors = [(out.double() - expected[:, :, mine]).abs().max().item()]
    errors += [
        (s.grad.double() - f.grad[:, :, mine]).abs().max().item()
        for s, f in zip(shard, full, strict=True)
    ]
    results[rank] = errors
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "size, heads, kv_heads, window, length",
    [(2, 4, 2, None, 7), (3, 3, 1, None, 5), (2, 2, 2, 4, 600)],
    ids=["2-ranks-gqa", "3-ranks-heads-not-dividing", "window-and-query-chunks"],
)
def test_ring_equals_attention_over_the_whole_sequence(
    size, heads, kv_heads, window, length, tmp_path
):
    """float32 ring vs float64 reference: each output sums <= N*L products of O(1) terms, so
    errors are a few float32 epsilons times sqrt(terms); 1e-5 bounds it with room."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(size, tmp_path, heads, kv_heads, window, length, results), nprocs=size)
    for rank in range(size):
        out_error, *grad_errors = results[rank]
        assert out_error < 1e-5, (rank, out_error)
        assert max(grad_errors) < 1e-5, (rank, grad_errors)
