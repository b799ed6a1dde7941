"""Every rank runs the same program on its slice: one process, DDP, FSDP2, tensor parallel,
and tensor parallel x FSDP2, all one strategy over one DeviceMesh.

`wrap` applies `parallelize` (TP -> activation checkpointing -> compile -> FSDP2 or DDP);
what differs between the layouts is carried by the model itself (a DDP wrapper, FSDP units,
DTensor parameters), so each method below is a short call into shared functions. Checkpoints:
replicated weights (one process, DDP) are written once by rank 0 as plain files or blocks
(--incremental_checkpoints); sharded ones (FSDP2, TP) go through DCP, with rank 0 also writing
the consolidated model or adapter. With --async_save both are written in the background.
"""

from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from swiftlm.checkpoint import replicated, sharded
from swiftlm.checkpoint.async_write import BackgroundWriter, Staging
from swiftlm.checkpoint.folders import save_pretrained_atomically
from swiftlm.distributed import gradients
from swiftlm.distributed.comm_timing import CommTimer, probe_bus_bandwidth
from swiftlm.distributed.compression import CommStats
from swiftlm.distributed.config import DistArguments
from swiftlm.distributed.ddp import compress_gradients
from swiftlm.distributed.env import DistContext
from swiftlm.distributed.fsdp2 import SkippedModules, reshard
from swiftlm.distributed.mesh import ParallelDims
from swiftlm.distributed.parallelize import ParallelizeOptions, parallelize, vision_modules
from swiftlm.errors import CheckpointError


class SPMDStrategy:
    pipeline_parallel = False

    def __init__(
        self,
        ctx: DistContext,
        device: torch.device,
        dims: ParallelDims,
        options: ParallelizeOptions,
        args: DistArguments | None = None,
    ):
        self.ctx, self.device, self.dims, self.options = ctx, device, dims, options
        self.args = args or DistArguments()
        self.comm_stats: CommStats | None = None
        self.saves = sharded.PendingSave()  # a background (--async_save) write in flight
        self.writer, self.staging = BackgroundWriter(), Staging()  # replicated async saves
        _, self.dp_rank, _ = dims.coordinates(ctx.rank)
        self.dp_size = dims.dp
        self.sp_rank, self.sp_size = dims.sp_rank(ctx.rank), dims.sp
        # FSDP2: modules a rank may skip (a vision-language model's vision parts)
        self.skipped = SkippedModules()

    def __str__(self) -> str:
        return str(self.dims)

    def wrap(self, model):
        mesh = self.dims.build_mesh(self.device.type)
        model = parallelize(model, self.dims, mesh, self.device, self.options)
        self.comm_stats = compress_gradients(model, self.args)
        if self.dims.gradient_ranks > 1 and self.dims.data_parallel == "fsdp2":
            self.skipped = SkippedModules(vision_modules(model))
        return model

    def attach_optimizer(self, model, optimizer):
        return model, optimizer  # the optimizer steps the local shards of DTensor params

    def unwrap(self, model):
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model, sync: bool):
        return gradients.gradient_sync(model, sync)

    def backward(self, loss, last_micro_batch: bool) -> None:
        gradients.backward(loss, last_micro_batch)

    def clip_and_step(self, model, optimizer, max_norm: float, scaler) -> float:
        self.skipped.drop_gradients()
        return gradients.clip_then_step(model.parameters(), optimizer, max_norm, scaler)

    @property
    def comm_timer(self) -> CommTimer | None:
        """Times DDP's gradient buckets (None: no DDP hook, e.g. one process or FSDP2)."""
        return self.comm_stats.timer if self.comm_stats else None

    def probe_link(self, model) -> float | None:
        """The gradient all-reduce's practical peak bus bandwidth (bytes/s), measured now."""
        if self.comm_stats is None:
            return None
        return probe_bus_bandwidth(model.process_group, self.device)

    def step_metrics(self) -> dict:
        """Gradient bytes this rank sent per optimizer step since the last call (DDP)."""
        per_step = self.comm_stats.read_and_reset() if self.comm_stats else None
        return {} if per_step is None else {"comm_bytes_per_rank": per_step}

    def pipeline_step(self, method, batches, scale, autocast) -> float:
        raise RuntimeError(f"{self} has no pipeline schedule; the loop runs its micro-batches")

    def save_state(self, folder: Path, model, optimizer):
        if not self.dims.sharded:
            self._wait_replicated()
            return self._save_replicated(folder, model, optimizer)
        self.saves.wait()  # one background save at a time: its data is still staged
        reshard(model)
        group = self.saves.group() if self.args.async_save else None
        pending = sharded.save_sharded_state(folder, model, optimizer, background_group=group)
        self.saves.track(pending, folder)
        full = sharded.gather_full_weights(model)  # a collective: every rank takes part
        if self.ctx.is_main:
            model.save_pretrained(folder, safe_serialization=True, state_dict=full)
        return pending

    def _wait_replicated(self) -> None:
        """Wait for rank 0's background write; if it failed, every rank stops with the error
        (the other ranks would otherwise wait for rank 0 at the next barrier)."""
        error = None
        try:
            self.saves.wait()
        except CheckpointError as exc:
            error = str(exc)
        if self.args.async_save and self.ctx.distributed:
            error = self.ctx.broadcast_object(error)
        if error is not None:
            raise CheckpointError(error)

    def _save_replicated(self, folder: Path, model, optimizer):
        """Rank 0 writes the one copy (replicas are identical): now, or in the background."""
        if not self.ctx.is_main:
            return None
        staging = self.staging if self.args.async_save else None
        incremental = self.args.incremental_checkpoints
        write = replicated.prepare_write(
            folder, self.unwrap(model), optimizer, incremental, staging
        )
        if staging is None:
            write()
            return None
        written, finished = self.writer.submit(write)
        self.saves.track(finished, folder)
        return written

    def load_state(self, folder: Path, model, optimizer) -> None:
        if not self.dims.sharded:
            replicated.load_weights_and_optimizer(folder, self.unwrap(model), optimizer)
            return
        reshard(model)
        if (folder / sharded.SHARDED_DIR).is_dir():
            sharded.load_sharded_state(folder, model, optimizer)
        elif self.dims.tp == 1:  # saved by one process or DDP: full tensors, sharded here
            sharded.load_full_state(folder, model, optimizer)
        else:  # torch does not split full optimizer states into tensor-parallel DTensors
            raise CheckpointError(
                f"{folder} has no sharded state ({sharded.SHARDED_DIR}/); resume a "
                "--tensor_parallel_size run from a checkpoint saved sharded (FSDP2 or TP)"
            )

    def save_final(self, model, tokenizer, folder: Path) -> None:
        if self.dims.sharded:
            self.saves.wait()
        else:
            self._wait_replicated()
        full = None
        if self.dims.sharded:
            reshard(model)
            full = sharded.gather_full_weights(model)  # a collective: every rank takes part
        if self.ctx.is_main:
            if self.comm_stats:  # the run's traffic, next to the uncompressed cost
                print(self.comm_stats.summary(), flush=True)
            save_pretrained_atomically(self.unwrap(model), tokenizer, folder, state_dict=full)
        self.ctx.barrier()
