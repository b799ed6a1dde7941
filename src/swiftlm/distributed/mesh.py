"""How the world is split: pipeline stages x data-parallel replicas x tensor-parallel ranks,
laid out on one DeviceMesh (torchtitan's ParallelDims, for swiftlm's three dimensions).

The mesh is ("pp", "dp", "tp") in row-major order: tensor-parallel ranks are consecutive (one
node's fast links carry their per-layer all-reduces), then the data-parallel replicas, then
the pipeline stages. Rank r therefore sits at
    pp = r // (dp * tp),  dp = (r // tp) % dp,  tp = r % tp.
Every rank of a tensor-parallel group and of a pipeline reads the same batch: the data is
split over the "dp" dimension only.
"""

from dataclasses import dataclass
from typing import Literal

MESH_DIMS = ("pp", "dp", "tp")

# How the "dp" dimension keeps its replicas in step: DDP all-reduces full gradients, FSDP2
# shards weights, gradients and optimizer state, DeepSpeed's engine does either itself.
DataParallel = Literal["ddp", "fsdp2", "deepspeed"]


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    data_parallel: DataParallel = "ddp"

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pipeline stage, data-parallel replica, tensor-parallel rank) of a global rank."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    @property
    def sharded(self) -> bool:
        """Whether parameters are DTensors (FSDP2 shards, tensor-parallel splits): their
        checkpoints are sharded (DCP) and full weights must be gathered to be saved."""
        return self.tp > 1 or (self.dp > 1 and self.data_parallel == "fsdp2")

    def build_mesh(self, device_type: str):
        """The DeviceMesh of the whole world (a collective: every rank calls it); None for a
        world of one, which has nothing to split."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_DIMS)

    def __str__(self) -> str:
        parts = []
        if self.pp > 1:
            parts.append(f"pipeline parallel {self.pp}")
        if self.tp > 1:
            parts.append(f"tensor parallel {self.tp}")
        if self.dp > 1 or self.data_parallel == "deepspeed":
            parts.append(f"{DATA_PARALLEL_NAMES[self.data_parallel]} {self.dp}")
        return " x ".join(parts) or "one process"


DATA_PARALLEL_NAMES = {"ddp": "DDP", "fsdp2": "FSDP2", "deepspeed": "DeepSpeed"}
