"""DistributedDataParallel: a full replica per process, gradients averaged in buckets."""

from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from swiftlm.config.sections import DistArguments
from swiftlm.distributed.common import clip_then_step
from swiftlm.distributed.compression import CommStats, check_compression, register_compression
from swiftlm.distributed.env import DistContext
from swiftlm.train import checkpoint as ckpt


class DDPStrategy:
    def __init__(self, ctx: DistContext, device: torch.device, args: DistArguments | None = None):
        self.ctx, self.device = ctx, device
        self.args = args or DistArguments()
        check_compression(self.args)  # a bad flag fails before the model loads
        self.comm_stats: CommStats | None = None

    dp_rank = property(lambda self: self.ctx.rank)
    dp_size = property(lambda self: self.ctx.world_size)

    def wrap(self, model):
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids)
        self.comm_stats = register_compression(ddp, self.args)
        return ddp

    def step_metrics(self) -> dict:
        """Gradient bytes this rank sent per optimizer step since the last call, for the log."""
        per_step = self.comm_stats.read_and_reset() if self.comm_stats else None
        return {} if per_step is None else {"comm_bytes_per_rank": per_step}

    def attach_optimizer(self, model, optimizer):
        return model, optimizer

    def unwrap(self, model):
        return model.module

    def no_sync(self, model, sync: bool):
        # Gradients are all-reduced once per optimizer step, on its last micro-batch.
        return nullcontext() if sync else model.no_sync()

    def clip_grad_norm(self, model, max_norm: float) -> float:
        # After the all-reduce every replica holds the same gradient: a local norm is global.
        params = [p for p in model.parameters() if p.requires_grad]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def backward(self, loss, last_micro_batch: bool) -> None:
        loss.backward()

    def clip_and_step(self, model, optimizer, max_norm: float, scaler) -> float:
        return clip_then_step(self, model, optimizer, max_norm, scaler)

    def save_state(self, folder: Path, model, optimizer) -> None:
        if self.ctx.is_main:  # replicas are identical; one copy is enough
            ckpt.save_weights_and_optimizer(folder, self.unwrap(model), optimizer)

    def load_state(self, folder: Path, model, optimizer) -> None:
        ckpt.load_weights_and_optimizer(folder, self.unwrap(model), optimizer)

    def save_final(self, model, tokenizer, folder: Path) -> None:
        if self.ctx.is_main:
            if self.comm_stats:  # the run's traffic, next to the uncompressed cost
                print(self.comm_stats.summary(), flush=True)
            ckpt.save_pretrained_atomically(self.unwrap(model), tokenizer, folder)
        self.ctx.barrier()
