"""DistributedDataParallel: a full replica per data-parallel rank, gradients averaged in
buckets over the mesh's "dp" dimension (the whole world, or a pipeline stage's replicas).

`--grad_compression` replaces the bucket all-reduce with a compressing communication hook
(compression.py); its byte counts go to the log through the strategy's `step_metrics`.
"""

import torch
from torch.nn.parallel import DistributedDataParallel

from swiftlm.distributed.compression import CommStats, register_compression
from swiftlm.distributed.config import DistArguments


def apply_ddp(
    model: torch.nn.Module,
    dp_mesh,
    device: torch.device,
    find_unused_parameters: bool = False,
    ignored: list[str] | tuple = (),
) -> DistributedDataParallel:
    """`find_unused_parameters`: some trainable parameters may get no gradient on a rank (a
    vision-language model's vision encoder on a rank whose micro-batch has no image); DDP
    then finds them after each forward and reduces zeros for them, at the cost of a graph
    traversal per micro-batch.

    `ignored`: names of parameters DDP neither broadcasts nor averages (expert shards, which
    differ per rank and are reduced by expert_parallel.py)."""
    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(ignored))
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(
        model,
        device_ids=device_ids,
        process_group=dp_mesh.get_group(),
        find_unused_parameters=find_unused_parameters,
    )


def compress_gradients(model, args: DistArguments) -> CommStats | None:
    """Register --grad_compression's hook on a DDP model; None for any other model."""
    if not isinstance(model, DistributedDataParallel):
        return None
    return register_compression(model, args, model.process_group)
