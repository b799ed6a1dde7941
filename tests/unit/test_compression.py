"""Top-k selection with error feedback, and the byte accounting, on plain tensors."""

import pytest
import torch

from swiftlm.config.sections import DistArguments
from swiftlm.dist import compression as gc
from swiftlm.errors import ConfigError


def test_topk_sends_the_largest_magnitudes_and_keeps_the_rest_as_residual():
    grad = torch.tensor([0.1, -3.0, 0.5, 2.0, -0.2])
    residual = torch.tensor([0.0, 0.0, -0.5, 0.0, 0.9])  # corrected: [.1, -3, 0, 2, .7]
    values, indices, new_residual = gc.topk_compress(grad, residual, k=2)
    assert indices.dtype == torch.int32
    assert sorted(zip(indices.tolist(), values.tolist(), strict=True)) == [(1, -3.0), (3, 2.0)]
    assert new_residual.tolist() == pytest.approx([0.1, 0.0, 0.0, 0.0, 0.7])
    # sent + residual == corrected: nothing is lost, only delayed
    sent = torch.zeros(5).index_add_(0, indices, values)
    assert (sent + new_residual).tolist() == pytest.approx((grad + residual).tolist())
    assert grad.tolist() == pytest.approx([0.1, -3.0, 0.5, 2.0, -0.2])  # input untouched


def test_error_feedback_eventually_sends_every_entry():
    # A constant gradient with k=1: the residual grows on unsent entries until each is picked,
    # so over many steps the total sent approaches steps x gradient on every entry.
    grad = torch.tensor([1.0, 0.5, 0.25, 0.125])
    residual, total = torch.zeros(4), torch.zeros(4)
    steps = 200
    for _ in range(steps):
        values, indices, residual = gc.topk_compress(grad, residual, k=1)
        total.index_add_(0, indices, values)
    assert (total + residual).tolist() == pytest.approx((steps * grad).tolist())
    assert residual.abs().max() < 2 * grad.sum()  # bounded: it does not grow with the steps
    assert (total / steps).tolist() == pytest.approx(grad.tolist(), abs=0.01)


def test_decompress_averages_ranks_and_adds_entries_picked_twice():
    # rank 0 sends {0: 4, 2: 2}, rank 1 sends {2: 6, 3: -2}
    values = torch.tensor([4.0, 2.0, 6.0, -2.0])
    indices = torch.tensor([0, 2, 2, 3], dtype=torch.int32)
    mean = gc.topk_decompress(5, values, indices, world_size=2)
    assert mean.tolist() == [2.0, 0.0, 4.0, -1.0, 0.0]


class FakeBucket:
    """What the top-k state reads from a DDP GradBucket: its parameters and flat buffer."""

    def __init__(self, params):
        self.params = params
        self.flat = torch.cat([p.grad.reshape(-1) for p in params])

    def parameters(self):
        return self.params

    def buffer(self):
        return self.flat


def test_residual_follows_its_parameter_when_ddp_rebuilds_the_buckets():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0])
    state = gc.TopKState(None, gc.CommStats("topk"), ratio=0.5)
    first = FakeBucket([a, b])
    assert state.residual_for(first).tolist() == [0.0] * 5  # nothing carried yet
    state.keep_residual(first, torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]))
    # After the first step DDP lays the same parameters out in another order.
    rebuilt = FakeBucket([b, a])
    assert state.residual_for(rebuilt).tolist() == pytest.approx([0.4, 0.5, 0.1, 0.2, 0.3])


@pytest.mark.parametrize(
    ("numel", "ratio", "k"), [(1000, 0.1, 100), (1001, 0.1, 101), (5, 0.01, 1), (7, 1.0, 7)]
)
def test_topk_count_keeps_at_least_one_and_at_most_all(numel, ratio, k):
    assert gc.topk_count(numel, ratio) == k


def test_topk_payload_is_values_plus_int32_indices():
    assert gc.topk_payload_bytes(100, torch.float32) == 800
    assert gc.topk_payload_bytes(100, torch.bfloat16) == 600


def test_ring_wire_bytes():
    # 2 ranks: each sends its payload once; 4 ranks: all-reduce 1.5x, all-gather 3x.
    assert gc.allreduce_wire_bytes(1000, 2) == 1000
    assert gc.allgather_wire_bytes(1000, 2) == 1000
    assert gc.allreduce_wire_bytes(1000, 4) == 1500
    assert gc.allgather_wire_bytes(1000, 4) == 3000


def test_comm_stats_reads_bytes_per_step_and_resets():
    stats = gc.CommStats("topk")
    assert stats.read_and_reset() is None  # no step ended yet
    for _ in range(3):  # 3 steps of two buckets; the last bucket ends the step
        stats.add(sent=100, dense=1000, ends_step=False)
        stats.add(sent=50, dense=500, ends_step=True)
    assert stats.read_and_reset() == 150
    assert stats.read_and_reset() is None
    stats.add(sent=30, dense=300, ends_step=True)
    assert stats.read_and_reset() == 30
    assert stats.total_steps == 4 and stats.per_step() == pytest.approx(480 / 4)
    assert stats.ratio() == pytest.approx(0.1)
    assert stats.summary() == (
        "grad compression topk: 120 bytes sent per rank per step (10.0% of uncompressed, 4 steps)"
    )


class RecordingDDP:
    """Stands in for DistributedDataParallel: records what would be registered."""

    def register_comm_hook(self, state, hook):
        self.state, self.hook = state, hook


@pytest.mark.parametrize(
    ("method", "hook"),
    [
        ("none", gc.allreduce_hook),
        ("fp16", gc.fp16_hook),
        ("bf16", gc.bf16_cast_hook),
        ("powersgd", gc.powersgd_hook),
        ("topk", gc.topk_hook),
    ],
)
def test_register_picks_the_hook_and_returns_its_counter(method, hook):
    ddp = RecordingDDP()
    stats = gc.register_compression(ddp, DistArguments(grad_compression=method, topk_ratio=0.1))
    assert ddp.hook is hook and ddp.state.stats is stats and stats.method == method
    if method == "topk":
        assert ddp.state.ratio == 0.1
    if method == "powersgd":
        assert ddp.state.powersgd.start_powerSGD_iter == gc.POWERSGD_START_STEP


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5])
def test_bad_topk_ratio_is_a_clear_config_error(ratio):
    with pytest.raises(ConfigError, match="--topk_ratio"):
        gc.check_compression(DistArguments(grad_compression="topk", topk_ratio=ratio))
