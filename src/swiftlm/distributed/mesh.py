"""How the world is split: pipeline stages x data-parallel replicas x sequence-parallel
ranks x tensor-parallel ranks, laid out on one DeviceMesh (torchtitan's ParallelDims, for
swiftlm's four dimensions).

The mesh is ("pp", "dp", "sp", "tp") in row-major order: tensor-parallel ranks are consecutive
(one node's fast links carry their per-layer all-reduces), then the sequence-parallel ranks
(an all-to-all per attention layer), then the data-parallel replicas, then the pipeline
stages. Rank r therefore sits at
    pp = r // (dp * sp * tp),  dp = (r // (sp * tp)) % dp,  sp = (r // tp) % sp,  tp = r % tp.
Every rank of a tensor-parallel group, of a sequence-parallel group and of a pipeline reads
the same samples: the data is split over the "dp" dimension only. A sequence-parallel group
then cuts each sample's tokens into one shard per rank (distributed/sequence_parallel.py), so
its ranks hold different losses: gradients are reduced over "dp" and "sp" together.
"""

from dataclasses import dataclass
from typing import Literal

MESH_DIMS = ("pp", "dp", "sp", "tp")

# How the "dp" dimension keeps its replicas in step: DDP all-reduces full gradients, FSDP2
# shards weights, gradients and optimizer state, DeepSpeed's engine does either itself.
DataParallel = Literal["ddp", "fsdp2", "deepspeed"]


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    data_parallel: DataParallel = "ddp"
    sp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.sp * self.tp

    @property
    def gradient_ranks(self) -> int:
        """Ranks whose gradients are reduced together: the data-parallel replicas and, within
        each, the sequence-parallel shards."""
        return self.dp * self.sp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pipeline stage, data-parallel replica, tensor-parallel rank) of a global rank."""
        sp_tp = self.sp * self.tp
        return rank // (self.dp * sp_tp), (rank // sp_tp) % self.dp, rank % self.tp

    def sp_rank(self, rank: int) -> int:
        """A global rank's index in its sequence-parallel group (which shard it holds)."""
        return (rank // self.tp) % self.sp

    def gradient_mesh(self, mesh):
        """The mesh DDP or FSDP2 reduces gradients over: "dp", or "dp" and "sp" flattened."""
        return mesh["dp"] if self.sp == 1 else mesh["dp", "sp"]._flatten("dp_sp")

    @property
    def sharded(self) -> bool:
        """Whether parameters are DTensors (FSDP2 shards, tensor-parallel splits): their
        checkpoints are sharded (DCP) and full weights must be gathered to be saved."""
        return self.tp > 1 or (self.gradient_ranks > 1 and self.data_parallel == "fsdp2")

    def build_mesh(self, device_type: str):
        """The DeviceMesh of the whole world (a collective: every rank calls it); None for a
        world of one, which has nothing to split."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.pp, self.dp, self.sp, self.tp)
        return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)

    def __str__(self) -> str:
        parts = []
        if self.pp > 1:
            parts.append(f"pipeline parallel {self.pp}")
        if self.tp > 1:
            parts.append(f"tensor parallel {self.tp}")
        if self.sp > 1:
            parts.append(f"sequence parallel {self.sp}")
        if self.dp > 1 or self.data_parallel == "deepspeed":
            parts.append(f"{DATA_PARALLEL_NAMES[self.data_parallel]} {self.dp}")
        return " x ".join(parts) or "one process"


DATA_PARALLEL_NAMES = {"ddp": "DDP", "fsdp2": "FSDP2", "deepspeed": "DeepSpeed"}
