"""The one interface the training loop uses to run on one process or many.

A strategy applies the parallelisms to the model, says which data-parallel slice this rank
reads, runs backward, clips and steps, and saves/loads weights + optimizer inside a checkpoint
folder. The loop branches on one fact only, `pipeline_parallel`: a pipeline schedule owns
forward and backward of the whole step. Three implementations:

- SPMDStrategy (spmd.py): one process, DDP, FSDP2, tensor parallel and TP x FSDP2;
  ExpertParallelStrategy (expert_strategy.py) is SPMDStrategy with the experts split;
- PipelineParallelStrategy (pp.py): pipeline stages, alone or x DDP / FSDP2;
- DeepSpeedStrategy (zero.py): the wrapper exception (its engine owns model and optimizer).
"""

from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import torch

from swiftlm.distributed.config import DistArguments
from swiftlm.distributed.env import DistContext
from swiftlm.distributed.mesh import ParallelDims
from swiftlm.distributed.parallelize import ParallelizeOptions
from swiftlm.train.config import TrainArguments


class Strategy(Protocol):
    ctx: DistContext
    dp_rank: int  # this rank's data-parallel slice (its index on the mesh's "dp" dimension)
    dp_size: int  # number of data-parallel slices
    # Sequence parallel: this rank's shard of each sample's tokens, of sp_size shards (1: off)
    sp_rank: int
    sp_size: int
    pipeline_parallel: bool  # True: the loop calls pipeline_step instead of its own micro-batches

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Apply the parallelisms in order (TP, activation checkpointing, compile, FSDP2/DDP;
        a pipeline stage first); return the model to train."""
        ...

    def attach_optimizer(self, model: torch.nn.Module, optimizer) -> tuple:
        """(model, optimizer) to train with; engines that need the optimizer start here."""
        ...

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def no_sync(self, model: torch.nn.Module, sync: bool) -> AbstractContextManager:
        """Reduce gradients over data-parallel ranks only when `sync` (the last micro-batch)."""
        ...

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None: ...

    def clip_and_step(self, model: torch.nn.Module, optimizer, max_norm: float, scaler) -> float:
        """Clip to max_norm and update; return the pre-clip global norm (not finite: skipped)."""
        ...

    def step_metrics(self) -> dict:
        """Figures for the step's log line since the last call (DDP's bytes sent); may be {}."""
        ...

    def pipeline_step(
        self,
        method,
        batches: list[dict],
        scale: float,
        autocast: Callable[[], AbstractContextManager],
    ) -> float:
        """Pipeline parallel only: run the step's micro-batches through the schedule. The last
        stage computes `method.pipeline_loss(logits, batch)` per micro-batch and backpropagates
        loss_sum * scale. Returns the step's unscaled loss sum of this data-parallel replica,
        the same on every stage of its pipeline."""
        ...

    def save_state(self, folder: Path, model: torch.nn.Module, optimizer) -> Future | None:
        """Write weights + optimizer into `folder` (every rank calls it). A Future when the
        data is still being written in the background (COMPLETE waits on it)."""
        ...

    def load_state(self, folder: Path, model: torch.nn.Module, optimizer) -> None: ...

    def save_final(self, model: torch.nn.Module, tokenizer, folder: Path) -> None:
        """Write the loadable model or adapter + tokenizer to `folder` (every rank calls it)."""
        ...


def plan_parallelism(args: DistArguments, world_size: int) -> ParallelDims:
    """The mesh the flags ask for. The flags' combinations are checked beforehand, once, by
    `config.rules.check` (which the training command runs first)."""
    pp, tp, sp = args.pipeline_parallel_size, args.tensor_parallel_size, args.sequence_parallel_size
    if args.deepspeed is not None:  # its engine also runs a world of one
        return ParallelDims(dp=world_size, data_parallel="deepspeed")
    if world_size == 1:
        return ParallelDims()  # a world of one has nothing to distribute
    pp = world_size if args.strategy == "pp" and pp == 1 else pp
    tp = world_size if args.strategy == "tp" and tp == 1 else tp
    dp = world_size // (pp * tp * sp)
    ep = args.expert_parallel_size  # a split of dp, not a factor of the world
    data_parallel = _data_parallel(args, tp, dp * sp)
    return ParallelDims(pp=pp, dp=dp, tp=tp, sp=sp, ep=ep, data_parallel=data_parallel)


def _data_parallel(args: DistArguments, tp: int, gradient_ranks: int) -> str:
    """DDP or FSDP2 for the ranks that reduce gradients (data-parallel replicas, sequence
    shards): FSDP2 when asked for, and beside tensor parallel (DDP cannot replicate DTensor
    weights)."""
    if args.fsdp is not None or args.strategy == "fsdp2" or (tp > 1 and gradient_ranks > 1):
        return "fsdp2"
    return "ddp"


def build_strategy(
    args: DistArguments,
    ctx: DistContext,
    device: torch.device,
    compute_dtype: torch.dtype = torch.float32,
    train: TrainArguments | None = None,
    max_length: int = 2048,
) -> Strategy:
    train = train or TrainArguments()
    dims = plan_parallelism(args, ctx.world_size)
    options = ParallelizeOptions(
        activation_checkpointing=train.gradient_checkpointing,
        compile=train.torch_compile,
        compute_dtype=compute_dtype,
        fsdp_offload=args.fsdp_offload,
        sequence_parallel_impl=args.sequence_parallel_impl,
    )
    if dims.data_parallel == "deepspeed":
        from swiftlm.distributed.zero import DeepSpeedStrategy

        return DeepSpeedStrategy(ctx, device, args.deepspeed, train, compute_dtype, options)
    if dims.pp > 1:
        from swiftlm.distributed.pp import PipelineParallelStrategy

        shape = (train.gradient_accumulation_steps, train.per_device_train_batch_size, max_length)
        return PipelineParallelStrategy(ctx, device, dims, options, shape, args.async_save)
    if dims.ep > 1:
        from swiftlm.distributed.expert_strategy import ExpertParallelStrategy

        return ExpertParallelStrategy(ctx, device, dims, options, args)
    from swiftlm.distributed.spmd import SPMDStrategy

    return SPMDStrategy(ctx, device, dims, options, args)
