"""Top-k selection with error feedback, and the byte accounting, on plain tensors."""

import pytest
import torch

from swiftlm.distributed import compression as gc
from swiftlm.distributed.config import DistArguments
from swiftlm.errors import ConfigError


def test_topk_sends_the_largest_magnitudes_and_keeps_the_rest_as_residual():
    grad = torch.tensor([0.1, -3.0, 0.5, 2.0, -0.2])
    residual = torch.tensor([0.0, 0.0, -0.5, 0.0, 0.9])  # corrected: [.1, -3, 0, 2, .7]
    values, positions, new_residual = gc.topk_compress(grad, residual, ratio=0.4)
    assert positions.dtype == torch.int16 and values.dtype == torch.float16
    picked = sorted(zip(positions.view(-1).tolist(), values.view(-1).tolist(), strict=True))
    assert picked == [(1, -3.0), (3, 2.0)]
    # Elementwise float32 sums, and fp16 values that hold -3 and 2 exactly: bit for bit.
    corrected = grad + residual
    assert torch.equal(new_residual, corrected * torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]))
    # sent + residual == corrected: nothing is lost, only delayed
    sent = gc.topk_decompress(5, values, positions, world_size=1)
    assert torch.equal(sent + new_residual, corrected)
    assert torch.equal(grad, torch.tensor([0.1, -3.0, 0.5, 2.0, -0.2]))  # input untouched


def test_fp16_rounding_is_carried_in_the_residual():
    grad = torch.tensor([1.0001, 0.0])
    values, positions, residual = gc.topk_compress(grad, torch.zeros(2), ratio=0.5)
    sent = gc.topk_decompress(2, values, positions, world_size=1)
    assert float(sent[0]) != float(grad[0])  # fp16 cannot hold it ...
    # ... the residual does: x - fp16(x) is exact (Sterbenz), and so is adding it back.
    assert float(sent[0] + residual[0]) == float(grad[0])


def test_large_buckets_are_cut_into_int16_blocks():
    numel = gc.BLOCK * 2 + 10
    grad = torch.randn(numel)
    values, positions, residual = gc.topk_compress(grad, torch.zeros(numel), ratio=0.1)
    assert positions.shape == (3, 2185) and int(positions.max()) < gc.BLOCK
    sent = gc.topk_decompress(numel, values, positions, world_size=1)
    # Unsent entries are kept whole; a sent one splits exactly into fp16(x) + (x - fp16(x)).
    assert torch.equal(sent + residual, grad)
    # about a tenth of the fp32 bytes
    assert gc.topk_payload_bytes(numel, 0.1) / (numel * 4) == pytest.approx(0.1, rel=0.02)


def test_error_feedback_eventually_sends_every_entry():
    # A constant gradient, one entry sent per step: the residual grows on unsent entries until
    # each is picked, so over many steps the total sent approaches steps x gradient everywhere.
    grad = torch.tensor([1.0, 0.5, 0.25, 0.125])
    residual, total = torch.zeros(4), torch.zeros(4)
    steps = 200
    for _ in range(steps):
        values, positions, residual = gc.topk_compress(grad, residual, ratio=0.25)
        total += gc.topk_decompress(4, values, positions, world_size=1)
    # Sums of multiples of 1/8 (grad's entries) far below 2**24 / 8: every one exact.
    assert torch.equal(total + residual, steps * grad)
    assert residual.abs().max() < 2 * grad.sum()  # bounded: it does not grow with the steps
    assert (total / steps).tolist() == pytest.approx(grad.tolist(), abs=0.01)


def test_decompress_averages_ranks_and_adds_entries_picked_twice():
    # rank 0 sends {0: 4, 2: 2}, rank 1 sends {2: 6, 3: -2}: [rows=1, k=2] each, stacked
    values = torch.tensor([[4.0, 2.0], [6.0, -2.0]], dtype=torch.float16)
    positions = torch.tensor([[0, 2], [2, 3]], dtype=torch.int16)
    mean = gc.topk_decompress(5, values, positions, world_size=2)
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
    assert torch.equal(state.residual_for(rebuilt), torch.tensor([0.4, 0.5, 0.1, 0.2, 0.3]))


@pytest.mark.parametrize(
    ("numel", "ratio", "k"), [(1000, 0.1, 100), (1001, 0.1, 101), (5, 0.01, 1), (7, 1.0, 7)]
)
def test_topk_count_keeps_at_least_one_and_at_most_all(numel, ratio, k):
    assert gc.topk_count(numel, ratio) == k


def test_topk_payload_is_fp16_values_plus_int16_positions():
    assert gc.topk_payload_bytes(1000, 0.1) == 100 * 4
    assert gc.topk_payload_bytes(2 * gc.BLOCK, 0.5) == 2 * (gc.BLOCK // 2) * 4


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
    # Registered timed (comm_timing.timed), around the chosen hook.
    assert ddp.hook.__wrapped__ is hook and ddp.state.stats is stats and stats.method == method
    if method == "topk":
        assert ddp.state.ratio == 0.1
    if method == "powersgd":
        assert ddp.state.powersgd.start_powerSGD_iter == gc.POWERSGD_START_STEP


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5])
def test_bad_topk_ratio_is_a_clear_config_error(ratio):
    with pytest.raises(ConfigError, match="--topk_ratio"):
        DistArguments(grad_compression="topk", topk_ratio=ratio)
