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

Expert parallel ("ep") is a split of "dp", not a fifth factor of the world (torchtitan's and
Megatron's layout): the data-parallel index d is (expert replica d // ep, expert rank d % ep),
so the mesh is ("pp", "ep_replica", "ep", "sp", "tp") and "dp" is "ep_replica" x "ep" flattened.
The ep consecutive data-parallel ranks of an expert group read different micro-batches and each
holds 1/ep of every MoE layer's experts (distributed/expert_parallel.py); the ranks of one
"ep_replica" group hold the same experts.
"""

from dataclasses import dataclass
from typing import Literal

MESH_DIMS = ("pp", "dp", "sp", "tp")
# With expert parallel, "dp" is split into the replicas of each expert shard x the expert ranks.
EXPERT_MESH_DIMS = ("pp", "ep_replica", "ep", "sp", "tp")

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
    ep: int = 1  # expert parallel: a split of dp (ep divides dp)

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
        """The mesh DDP or FSDP2 reduces gradients over: "dp", or "dp" and "sp" flattened
        (under expert parallel, "ep_replica" and "ep" flattened: the same ranks as "dp")."""
        if self.ep > 1:  # "dp" is the expert replicas x the expert ranks, in the same order
            return mesh["ep_replica", "ep"]._flatten("dp")
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

        if self.ep == 1:
            shape = (self.pp, self.dp, self.sp, self.tp)
            return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        shape = (self.pp, self.dp // self.ep, self.ep, self.sp, self.tp)
        return init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_MESH_DIMS)

    def __str__(self) -> str:
        parts = []
        if self.pp > 1:
            parts.append(f"pipeline parallel {self.pp}")
        if self.tp > 1:
            parts.append(f"tensor parallel {self.tp}")
        if self.sp > 1:
            parts.append(f"sequence parallel {self.sp}")
        if self.dp > 1 or self.data_parallel == "deepspeed":
            experts = f" with expert parallel {self.ep}" if self.ep > 1 else ""
            parts.append(f"{DATA_PARALLEL_NAMES[self.data_parallel]} {self.dp}{experts}")
        return " x ".join(parts) or "one process"


DATA_PARALLEL_NAMES = {"ddp": "DDP", "fsdp2": "FSDP2", "deepspeed": "DeepSpeed"}
