"""The one interface the training loop uses to run on one process or many.

A strategy wraps the model (DDP, FSDP2 ...), says where its data-parallel slice is, clips the
gradient, and saves/loads weights + optimizer inside a checkpoint folder. The loop never
branches on the strategy's name.
"""

from concurrent.futures import Future
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import torch

from swiftlm.config.sections import DistArguments, TrainArguments
from swiftlm.distributed.env import DistContext
from swiftlm.errors import ConfigError


class Strategy(Protocol):
    ctx: DistContext

    @property
    def dp_rank(self) -> int: ...  # this process's data-parallel slice

    @property
    def dp_size(self) -> int: ...  # number of data-parallel slices

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def no_sync(self, model: torch.nn.Module, sync: bool) -> AbstractContextManager: ...

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float: ...

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None: ...

    def clip_and_step(self, model: torch.nn.Module, optimizer, max_norm: float, scaler) -> float:
        """Clip to max_norm and update; return the pre-clip gradient norm (nan: skipped)."""
        ...

    # A Future when the data is still being written in the background (COMPLETE waits on it).
    def save_state(self, folder: Path, model: torch.nn.Module, optimizer) -> Future | None: ...

    def load_state(self, folder: Path, model: torch.nn.Module, optimizer) -> None: ...

    def save_final(self, model: torch.nn.Module, tokenizer, folder: Path) -> None: ...


def choose_strategy_name(args: DistArguments, world_size: int) -> str:
    if args.pipeline_parallel_size > 1:
        if args.deepspeed or args.fsdp or args.tensor_parallel_size > 1:
            raise ConfigError("--pipeline_parallel_size cannot be combined with other engines yet")
        return "pp" if world_size > 1 else "single"
    if args.tensor_parallel_size > 1 or args.strategy == "tp":
        if args.deepspeed is not None or args.fsdp is not None:
            raise ConfigError("--tensor_parallel_size conflicts with --deepspeed / --fsdp")
        return "tp" if world_size > 1 else "single"
    if args.deepspeed is not None:
        if args.fsdp is not None or args.strategy not in ("auto", "deepspeed"):
            raise ConfigError("--deepspeed conflicts with --fsdp / --strategy; pick one engine")
        return "deepspeed"
    if args.fsdp is not None:
        if args.fsdp not in ("fsdp2", "full_shard", "shard"):
            raise ConfigError(f"--fsdp {args.fsdp}: use fsdp2 (FSDP2, fully_shard per layer)")
        if args.strategy not in ("auto", "fsdp2"):
            raise ConfigError(f"--fsdp conflicts with --strategy {args.strategy}")
        return "fsdp2" if world_size > 1 else "single"  # one process has nothing to shard
    if args.strategy != "auto":
        if args.strategy != "single" and world_size == 1:
            return "single"  # a world of one has nothing to distribute
        return args.strategy
    return "single" if world_size == 1 else "ddp"


def build_strategy(
    args: DistArguments,
    ctx: DistContext,
    device: torch.device,
    compute_dtype: torch.dtype = torch.float32,
    train: TrainArguments | None = None,
    max_length: int = 2048,
) -> Strategy:
    name = choose_strategy_name(args, ctx.world_size)
    if args.grad_compression != "none" and name not in ("ddp", "single"):
        raise ConfigError(
            f"--grad_compression {args.grad_compression} compresses DDP's all-reduce; "
            f"--strategy {name} does not use it: drop the flag or use DDP"
        )
    if name == "single" and ctx.world_size > 1:
        raise ConfigError("--strategy single cannot run with several processes; use ddp or fsdp2")
    if name == "single":
        from swiftlm.distributed.single import SingleStrategy

        return SingleStrategy(ctx)
    if name == "ddp":
        from swiftlm.distributed.ddp import DDPStrategy

        return DDPStrategy(ctx, device, args)
    if name == "deepspeed":
        from swiftlm.distributed.zero import DeepSpeedStrategy

        return DeepSpeedStrategy(
            ctx, device, args.deepspeed, train or TrainArguments(), compute_dtype
        )
    if name == "pp":
        from swiftlm.distributed.pp import PipelineParallelStrategy

        train = train or TrainArguments()
        return PipelineParallelStrategy(
            ctx, device, args.pipeline_parallel_size, max_length, train.gradient_accumulation_steps
        )
    if name == "tp":
        from swiftlm.distributed.tp import TensorParallelStrategy

        size = args.tensor_parallel_size if args.tensor_parallel_size > 1 else ctx.world_size
        return TensorParallelStrategy(ctx, device, size, compute_dtype)
    from swiftlm.distributed.fsdp2 import FSDP2Strategy

    return FSDP2Strategy(ctx, device, args, compute_dtype)
