"""DDP or FSDP2 with the experts split (`--expert_parallel_size N`): SPMDStrategy, plus what
expert shards need around its steps (distributed/expert_parallel.py explains the layout).

- wrap: the model's experts are checked, then split by `parallelize` (before DDP or FSDP2,
  which are told to leave the shards alone);
- clip_and_step: the shards' gradients are reduced over their replicas, and the global norm
  counts every shard once;
- save_state / load_state / save_final: around SPMDStrategy's checkpoints (replicated files,
  or DCP's sharded state), the full experts are gathered, so the files are those of the same
  run without expert parallel (the run layout is unchanged) and each rank keeps its slice of
  what was loaded.
"""

from pathlib import Path

from swiftlm.distributed.ddp import compress_gradients
from swiftlm.distributed.expert_parallel import ExpertShards, check_expert_parallel
from swiftlm.distributed.fsdp2 import SkippedModules
from swiftlm.distributed.parallelize import parallelize, vision_modules
from swiftlm.distributed.spmd import SPMDStrategy


class ExpertParallelStrategy(SPMDStrategy):
    shards: ExpertShards

    def wrap(self, model):
        check_expert_parallel(model, self.dims.ep)
        mesh = self.dims.build_mesh(self.device.type)
        model = parallelize(model, self.dims, mesh, self.device, self.options)
        self.comm_stats = compress_gradients(model, self.args)
        if self.dims.data_parallel == "fsdp2":
            self.skipped = SkippedModules(vision_modules(model))
        self.shards = ExpertShards.of(self.unwrap(model), mesh, self.dims.dp)
        return model

    def clip_and_step(self, model, optimizer, max_norm: float, scaler) -> float:
        self.skipped.drop_gradients()
        return self.shards.clip_then_step(model.parameters(), optimizer, max_norm, scaler)

    def save_state(self, folder: Path, model, optimizer):
        # A background save (--async_save) copies the full tensors before this returns.
        with self.shards.gathered(optimizer):
            return super().save_state(folder, model, optimizer)

    def load_state(self, folder: Path, model, optimizer) -> None:
        with self.shards.gathered(optimizer):
            super().load_state(folder, model, optimizer)

    def save_final(self, model, tokenizer, folder: Path) -> None:
        with self.shards.gathered():
            super().save_final(model, tokenizer, folder)
