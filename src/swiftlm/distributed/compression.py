"""Gradient compression for DDP: communication hooks that send fewer bytes per step.

`--grad_compression` picks how DDP exchanges each gradient bucket:

- none: plain fp32 all-reduce (DDP's default), counted so that savings can be compared.
- fp16: torch's `fp16_compress_hook`, half the bytes.
- bf16: a cast hook written here, half the bytes. torch's own `bf16_compress_hook` refuses any
  backend but NCCL/XCCL by its name, although gloo all-reduces bfloat16 fine.
- powersgd: torch's PowerSGD (rank-1 factors with error feedback) after two plain steps.
- topk: each rank sends only the `--topk_ratio` largest entries of each block of its bucket
  (values and int16 positions, exchanged with all-gather). The entries it drops are kept as a
  residual and added to the next step's gradient (error feedback), so no gradient mass is
  lost, only late. The residuals (and PowerSGD's state) are saved with each checkpoint
  (`compression_checkpoint`), so a compressed run resumes exactly.

Every hook adds to a `CommStats`: the bytes each rank sends per optimizer step under the
textbook ring algorithms (all-reduce: 2(n-1)/n x payload; all-gather: (n-1) x payload), next
to what a plain all-reduce of the same buckets would send. The ring model keeps the
comparison honest as ranks are added: top-k's all-gather grows with the world size, an
all-reduce does not. At 2 ranks both equal the payload.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from swiftlm.distributed.comm_timing import CommTimer, timed
from swiftlm.distributed.compression_checkpoint import CompressionCheckpoint, PowerSGDLayouts
from swiftlm.distributed.config import DistArguments

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "topk")
# Top-k sends each kept entry as an fp16 value and an int16 position inside its block of
# BLOCK entries: 4 bytes, against 4 for the fp32 entry itself (8 with int32 indices).
VALUE_DTYPE = torch.float16
INDEX_DTYPE = torch.int16
BLOCK = 32768  # the positions 0..32767 fit int16
# PowerSGD's hyperparameters are fixed here rather than flags: rank 1 still compresses the
# small matrices of LoRA adapters, and two plain steps let DDP rebuild its buckets first
# (torch requires >= 2 with error feedback for that reason).
POWERSGD_RANK = 1
POWERSGD_START_STEP = 2


# ---- byte accounting ---------------------------------------------------------------------


def allreduce_wire_bytes(payload: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `payload` bytes."""
    return round(2 * (world_size - 1) * payload / world_size)


def allgather_wire_bytes(payload: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-gather where each rank contributes `payload` bytes."""
    return (world_size - 1) * payload


@dataclass
class CommStats:
    """Gradient bytes this rank sends, per optimizer step, next to the uncompressed cost."""

    method: str
    sent: int = 0  # since the last `read_and_reset`
    steps: int = 0
    total_sent: int = 0  # whole run, for the summary line
    total_dense: int = 0
    total_steps: int = 0
    timer: CommTimer = field(default_factory=CommTimer)  # when each bucket's collective ran
    checkpoint: CompressionCheckpoint | None = None  # its state, saved with each checkpoint

    def add(self, sent: int, dense: int, ends_step: bool) -> None:
        """Count one bucket; `ends_step` marks the step's last bucket (DDP's `is_last`)."""
        self.sent += sent
        self.total_sent, self.total_dense = self.total_sent + sent, self.total_dense + dense
        if ends_step:
            self.steps, self.total_steps = self.steps + 1, self.total_steps + 1

    def read_and_reset(self) -> int | None:
        """Mean bytes per step since the last call (None if no step ended), then start over.

        Averaging over the window lets the loop log every `--logging_steps` without losing
        the steps in between.
        """
        per_step = round(self.sent / self.steps) if self.steps else None
        self.sent, self.steps = 0, 0
        return per_step

    def per_step(self) -> float:
        return self.total_sent / max(self.total_steps, 1)

    def ratio(self) -> float:
        """Bytes sent over the bytes a plain all-reduce would have sent, whole run."""
        return self.total_sent / max(self.total_dense, 1)

    def summary(self) -> str:
        return (
            f"grad compression {self.method}: {self.per_step():,.0f} bytes sent per rank per step "
            f"({100 * self.ratio():.1f}% of uncompressed, {self.total_steps} steps)"
        )


def _dense_bytes(bucket: dist.GradBucket, world_size: int) -> int:
    buffer = bucket.buffer()
    return allreduce_wire_bytes(buffer.numel() * buffer.element_size(), world_size)


# ---- top-k with error feedback: pure math ------------------------------------------------


def topk_count(numel: int, ratio: float) -> int:
    """Entries kept out of `numel`: at least one, so every bucket still moves."""
    return min(numel, max(1, math.ceil(ratio * numel)))


def topk_blocks(numel: int) -> tuple[int, int]:
    """(rows, block size): the bucket cut into equal blocks small enough for int16 positions
    (equal, so that the padding of the last block stays under one entry per block)."""
    rows = math.ceil(numel / BLOCK)
    return rows, math.ceil(numel / rows)


def topk_compress(
    grad: torch.Tensor, residual: torch.Tensor, ratio: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, positions, new residual): the largest-magnitude `ratio` of each block of
    grad + residual, as fp16 values and int16 positions inside the block (4 bytes an entry,
    so 10% of the entries cost 10% of the fp32 bytes).

    The new residual is what was not sent, fp16 rounding included: it joins the next step.
    """
    corrected = grad + residual
    rows, size = topk_blocks(corrected.numel())
    blocks = F.pad(corrected, (0, rows * size - corrected.numel())).view(rows, size)
    positions = blocks.abs().topk(topk_count(size, ratio), dim=1, sorted=False).indices
    fp16_max = torch.finfo(VALUE_DTYPE).max
    values = blocks.gather(1, positions).clamp_(-fp16_max, fp16_max).to(VALUE_DTYPE)
    sent = torch.zeros_like(blocks).scatter_(1, positions, values.to(blocks.dtype))
    new_residual = (blocks - sent).view(-1)[: corrected.numel()]
    return values, positions.to(INDEX_DTYPE), new_residual


def topk_decompress(
    numel: int, values: torch.Tensor, positions: torch.Tensor, world_size: int, dtype=torch.float32
) -> torch.Tensor:
    """Mean over ranks of their sparse gradients; `values`/`positions` stack every rank's
    [rows, k] picks along dim 0. Ranks may pick the same entry: add, don't overwrite."""
    rows, size = topk_blocks(numel)
    dense = torch.zeros(rows, size, dtype=dtype, device=values.device)
    for rank_values, rank_positions in zip(values.split(rows), positions.split(rows), strict=True):
        dense.scatter_add_(1, rank_positions.long(), rank_values.to(dtype))
    return dense.view(-1)[:numel].div_(world_size)


def topk_payload_bytes(numel: int, ratio: float) -> int:
    """Bytes one rank contributes for a bucket of `numel` entries: values and positions."""
    rows, size = topk_blocks(numel)
    return rows * topk_count(size, ratio) * (VALUE_DTYPE.itemsize + INDEX_DTYPE.itemsize)


# ---- hooks ------------------------------------------------------------------------------


@dataclass
class HookState:
    process_group: dist.ProcessGroup | None
    stats: CommStats

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)


@dataclass
class TopKState(HookState):
    ratio: float
    # id(parameter) -> its share of the residual (what was not sent yet)
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    # id(parameter) -> its place among the model's parameters: the order top-k lays a
    # bucket out in before it cuts blocks, whatever order DDP put the bucket in
    order: dict[int, int] = field(default_factory=dict)

    def canonical(self, bucket: dist.GradBucket) -> list[int]:
        """The bucket's parameters (their positions in it) in the model's order.

        DDP builds each process's buckets in reverse parameter order, then rebuilds them
        after the first step in the order gradients became ready, so a resumed run's first
        step sees the parameters in another order than the saved run's last step did. The
        blocks top-k picks from are cut in the model's order, the same in both.
        """
        params = bucket.parameters()
        return sorted(range(len(params)), key=lambda i: self.order.get(id(params[i]), i))

    def residual_for(self, bucket: dist.GradBucket) -> torch.Tensor:
        """The residual over the bucket's flat buffer; zeros for parameters not seen yet.

        Residuals are kept per parameter, not per bucket: DDP rebuilds its buckets after the
        first step, in another order, and each residual must stay with its parameter.
        """
        zeros = bucket.buffer().new_zeros
        return torch.cat(
            [
                self.residuals[id(p)] if id(p) in self.residuals else zeros(p.numel())
                for p in bucket.parameters()
            ]
        )

    def keep_residual(self, bucket: dist.GradBucket, residual: torch.Tensor) -> None:
        params = bucket.parameters()  # the buffer is their gradients, concatenated in order
        parts = residual.split([p.numel() for p in params])
        self.residuals.update(zip(map(id, params), parts, strict=True))


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce, counted."""
    dense = _dense_bytes(bucket, state.world_size)
    state.stats.add(dense, dense, bucket.is_last())
    return default_hooks.allreduce_hook(state.process_group, bucket)


def fp16_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's fp16 compression, counted."""
    _count_cast(state, bucket, torch.float16)
    return default_hooks.fp16_compress_hook(state.process_group, bucket)


def bf16_cast_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in bfloat16 and cast the mean back, on any backend."""
    _count_cast(state, bucket, torch.bfloat16)
    buffer = bucket.buffer()
    # Divide before summing so that the sum cannot overflow (as torch's fp16 hook does).
    compressed = buffer.to(torch.bfloat16).div_(state.world_size)
    work = dist.all_reduce(compressed, group=state.process_group, async_op=True)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])  # in place: no second fp32 copy of the bucket

    return work.get_future().then(decompress)


def _count_cast(state: HookState, bucket: dist.GradBucket, dtype: torch.dtype) -> None:
    numel, world = bucket.buffer().numel(), state.world_size
    sent = allreduce_wire_bytes(numel * dtype.itemsize, world)
    state.stats.add(sent, _dense_bytes(bucket, world), bucket.is_last())


@dataclass
class PowerSGDCountingState(HookState):
    powersgd: powersgd.PowerSGDState
    layouts: PowerSGDLayouts | None = None  # its buffers matched to DDP's current buckets


def powersgd_hook(
    state: PowerSGDCountingState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's PowerSGD, counted from the element counts it keeps itself."""
    ps, world = state.powersgd, state.world_size
    if state.layouts is not None:
        state.layouts.align(bucket)
    dense = _dense_bytes(bucket, world)
    plain = ps.iter < ps.start_powerSGD_iter  # PowerSGD all-reduces plainly before its start
    before = ps.total_numel_after_compression
    fut = powersgd.powerSGD_hook(ps, bucket)
    compressed = (ps.total_numel_after_compression - before) * bucket.buffer().element_size()
    sent = dense if plain else allreduce_wire_bytes(compressed, world)
    state.stats.add(sent, dense, bucket.is_last())
    return fut


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Send the largest entries (+ residual) of this rank's bucket, laid out in the model's
    parameter order (`TopKState.canonical`); average all ranks' picks."""
    buffer, world = bucket.buffer(), state.world_size
    order = state.canonical(bucket)
    sizes = [p.numel() for p in bucket.parameters()]
    grads, residuals = buffer.split(sizes), state.residual_for(bucket).split(sizes)
    laid_out = [torch.cat([parts[i] for i in order]) for parts in (grads, residuals)]
    values, indices, residual = topk_compress(laid_out[0], laid_out[1], state.ratio)
    parts = dict(zip(order, residual.split([sizes[i] for i in order]), strict=True))
    state.keep_residual(bucket, torch.cat([parts[i] for i in range(len(sizes))]))
    sent = allgather_wire_bytes(topk_payload_bytes(buffer.numel(), state.ratio), world)
    state.stats.add(sent, _dense_bytes(bucket, world), bucket.is_last())
    # One byte buffer per rank (gloo has no int16 collectives); k is the same on every rank
    # for a given bucket, so all-gather's equal sizes hold.
    payload = torch.cat(
        [values.reshape(-1).view(torch.uint8), indices.reshape(-1).view(torch.uint8)]
    )
    gathered = [torch.empty_like(payload) for _ in range(world)]
    work = dist.all_gather(gathered, payload, group=state.process_group, async_op=True)

    def decompress(_: torch.futures.Future) -> torch.Tensor:
        split = values.numel() * values.element_size()
        all_values = torch.cat([g[:split].view(VALUE_DTYPE).view(values.shape) for g in gathered])
        all_indices = torch.cat([g[split:].view(INDEX_DTYPE).view(indices.shape) for g in gathered])
        mean = topk_decompress(buffer.numel(), all_values, all_indices, world, buffer.dtype)
        means = mean.split([sizes[i] for i in order])
        for i, part in zip(order, means, strict=True):  # back into the bucket's order
            grads[i].copy_(part)
        return buffer

    return work.get_future().then(decompress)


# ---- choosing ---------------------------------------------------------------------------


def register_compression(
    ddp_model: torch.nn.Module, args: DistArguments, process_group: dist.ProcessGroup | None = None
) -> CommStats:
    """Register the communication hook that --grad_compression names; return its byte counter.

    Must run before the first forward. `none` also registers a (counting) hook, in place of
    DDP's built-in C++ all-reduce, so that every run can report its bytes. Every hook is
    timed (`comm_timing.timed`): busy time, exposed time and bus bandwidth in the log.
    """
    method = args.grad_compression
    stats = CommStats(method)
    common = HookState(process_group, stats)
    params = _named_parameters(ddp_model)
    if method == "powersgd":
        ps = powersgd.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=POWERSGD_RANK,
            start_powerSGD_iter=POWERSGD_START_STEP,
        )
        layouts = PowerSGDLayouts(ps, {id(p): p for p in params.values()})
        state, hook = PowerSGDCountingState(process_group, stats, ps, layouts), powersgd_hook
    elif method == "topk":
        order = {id(p): i for i, p in enumerate(params.values())}
        state = TopKState(process_group, stats, ratio=args.topk_ratio, order=order)
        hook = topk_hook
    else:
        hooks = {"none": allreduce_hook, "fp16": fp16_hook, "bf16": bf16_cast_hook}
        state, hook = common, hooks[method]
    ddp_model.register_comm_hook(state, timed(hook, stats.timer))
    stats.checkpoint = CompressionCheckpoint(method, state, params)
    return stats


def _named_parameters(ddp_model) -> dict[str, torch.nn.Parameter]:
    """The wrapped model's parameters by name: how checkpoints key each rank's state."""
    module = getattr(ddp_model, "module", None)
    return dict(module.named_parameters()) if module is not None else {}
