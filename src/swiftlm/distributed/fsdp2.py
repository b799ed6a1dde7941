"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the
data-parallel ranks.

Every transformer block is one FSDP unit, all-gathered just before it runs and freed after;
the root unit holds the rest (embeddings, final norm, head). Gradients are reduce-scattered
and averaged over ranks, like DDP, so the loop's loss scaling applies unchanged. Applied last
in `parallelize`, over the mesh's "dp" dimension: after tensor parallel it shards the
DTensor blocks on a 2-D mesh, and under pipeline parallel it shards one stage.

Weights: frozen and trainable parameters of a unit may differ in dtype (bf16 base + fp32
LoRA), trainable ones are float32. On CUDA, weights are gathered in the compute dtype.
"""

import torch
from torch import nn

from swiftlm.errors import ConfigError


def apply_fsdp2(
    model: nn.Module,
    dp_mesh,
    device: torch.device,
    compute_dtype: torch.dtype = torch.float32,
    offload: bool = False,
) -> nn.Module:
    """Shard every block list's blocks, then the root, over `dp_mesh` (in place)."""
    from torch.distributed.fsdp import fully_shard

    train_in_float32(model)
    policy = mixed_precision_policy(device, compute_dtype)
    offloading = offload_policy(device, offload)
    for blocks in find_block_lists(model):
        for i, block in enumerate(blocks):
            # The last block runs first in backward: keeping it gathered saves a gather.
            fully_shard(
                block,
                mesh=dp_mesh,
                mp_policy=policy,
                offload_policy=offloading,
                reshard_after_forward=i < len(blocks) - 1,
            )
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, offload_policy=offloading)
    return model


def offload_policy(device: torch.device, offload: bool):
    """CPUOffloadPolicy for --fsdp_offload on GPUs. On a CPU the weights are already in CPU
    memory, so there is nothing to move: the default (no offload) policy is used."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return CPUOffloadPolicy() if offload and device.type == "cuda" else OffloadPolicy()


def mixed_precision_policy(device: torch.device, compute_dtype: torch.dtype):
    """Gather weights in the compute dtype on CUDA; reduce gradients in float32 always.

    On CPU the weights stay as they are and the loop's autocast does the low-precision math.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = device.type == "cuda" and compute_dtype in (torch.bfloat16, torch.float16)
    return MixedPrecisionPolicy(
        param_dtype=compute_dtype if low else None, reduce_dtype=torch.float32
    )


def reshard(model: nn.Module) -> None:
    """Register the sharded parameters everywhere again (local, no communication).

    The root and the last block keep their gathered weights after forward, for backward; a
    forward without backward (evaluation) leaves them gathered, and state dicts would then
    see plain tensors the optimizer does not know. A model without FSDP units is left as is.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def train_in_float32(model: nn.Module) -> None:
    """Keep trainable weights in float32, as swiftlm does everywhere.

    FSDP2 reduce-scatters the gradients of a unit together, so its trainable parameters need
    one dtype; frozen ones may differ (bf16 base weights + fp32 LoRA share a unit fine). A
    trainable copy made in the base dtype (peft modules_to_save) would break that.
    """
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()


def find_block_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The lists of transformer blocks: the outermost ModuleLists of same-class modules.

    Models keep them at different paths (model.layers, transformer.h, a vision tower's own
    list ...), and peft adds a prefix; their shape finds them all. Lists nested inside a
    block (such as MoE experts, which ranks run unevenly) stay part of that block's unit.
    """
    found: list[nn.ModuleList] = []
    inside: set[int] = set()
    for module in model.modules():  # parents come before their children
        if id(module) in inside:
            continue
        if _is_block_list(module):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    if not found:
        raise ConfigError(
            f"--strategy fsdp2 found no list of transformer blocks in {type(model).__name__} "
            "to shard; use --strategy ddp for this model"
        )
    return found


def _is_block_list(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.ModuleList)
        and len(module) > 0
        and len({type(block) for block in module}) == 1
        and any(True for _ in module.parameters())
    )
