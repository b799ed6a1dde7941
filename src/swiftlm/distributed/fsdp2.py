"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the
data-parallel ranks.

Every transformer block is one FSDP unit, all-gathered just before it runs and freed after;
the root unit holds the rest (embeddings, final norm, head). Gradients are reduce-scattered
and averaged over ranks, like DDP, so the loop's loss scaling applies unchanged. Applied last
in `parallelize`, over the mesh's "dp" dimension: after tensor parallel it shards the
DTensor blocks on a 2-D mesh, and under pipeline parallel it shards one stage.

Vision-language models: a rank runs the vision encoder and aligner only when its micro-batch
has images, while every FSDP unit's all-gather and reduce-scatter are collectives all ranks
must make. Those parts therefore stay in the root unit (gathered with it on every rank, not
block by block), whose reduce-scatter includes zero gradients for the parameters a rank did
not use. A step in which no rank has an image thus gives the trainable vision parameters zero
gradients; SkippedModules turns those back into none, as one process and DDP leave them,
before the optimizer steps. same_reduction_order keeps the units' reductions in one order.

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
    in_root: list[nn.Module] | tuple = (),
    ignored: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard every block list's blocks, then the root, over `dp_mesh` (in place).

    `in_root`: modules whose blocks stay in the root unit (a vision-language model's vision
    encoder and aligner, which ranks run or skip by their micro-batches' images).
    `ignored`: parameters FSDP2 leaves as they are (expert shards, which differ per rank and
    are reduced by expert_parallel.py)."""
    from torch.distributed.fsdp import fully_shard

    train_in_float32(model)
    policy = mixed_precision_policy(device, compute_dtype)
    offloading = offload_policy(device, offload)
    for blocks in find_block_lists(model, skip=in_root):
        for i, block in enumerate(blocks):
            # The last block runs first in backward: keeping it gathered saves a gather.
            fully_shard(
                block,
                mesh=dp_mesh,
                mp_policy=policy,
                offload_policy=offloading,
                reshard_after_forward=i < len(blocks) - 1,
                ignored_params=ignored,
            )
    fully_shard(
        model, mesh=dp_mesh, mp_policy=policy, offload_policy=offloading, ignored_params=ignored
    )
    if in_root:  # a rank that skipped them reduce-scatters zeros, keeping the ranks in step
        model.set_reduce_scatter_unused_params(True, recurse=False)
        same_reduction_order(model)
    return model


def same_reduction_order(model: nn.Module) -> None:
    """Make every rank reduce-scatter its units in the same order.

    A unit reduces when autograd reaches its input, or, if its input needs no gradient, at
    the end of backward after the root unit. With frozen token embeddings (LoRA) and a trained
    vision part, the first language-model block's input (the embeddings with image features
    merged in) needs a gradient only on a rank whose micro-batch has images, so ranks would
    reduce that block and the root in different orders, and gloo would fail on mismatched
    sizes. Marking the token embeddings' output as needing a gradient keeps the order the same
    on all ranks. (transformers' enable_input_require_grads would also mark the vision
    encoder's patch embeddings, running backward through a frozen vision encoder for nothing.)
    """
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    if isinstance(embeddings, nn.Module):
        embeddings.register_forward_hook(_require_grad)


def _require_grad(module, args, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)


class SkippedModules:
    """Gives no gradient to the parameters of modules that no rank ran in a step.

    The root unit reduce-scatters zeros for the parameters a rank did not use (apply_fsdp2's
    `in_root`), so after the reduction a parameter no rank used has a zero gradient, where one
    process or DDP leaves it none, which AdamW skips (no momentum, no weight decay, no step
    count). A forward hook notes which of `in_root`'s modules with trainable parameters ran
    with gradients on; before the optimizer step one small all-reduce tells every rank which
    ran nowhere, and their parameters' gradients are dropped. (A zero gradient cannot tell:
    LoRA's A matrices get exactly zero ones while B is still zero.)"""

    def __init__(self, in_root: list[nn.Module] | tuple = ()):
        seen: dict[int, nn.Module] = {}
        for root in in_root:
            for module in root.modules():
                if any(p.requires_grad for p in module.parameters(recurse=False)):
                    seen.setdefault(id(module), module)
        self.modules = list(seen.values())
        self.ran = [False] * len(self.modules)
        for index, module in enumerate(self.modules):
            module.register_forward_hook(self._hook(index))

    def _hook(self, index: int):
        def mark(module, args, output):
            if torch.is_grad_enabled():
                self.ran[index] = True

        return mark

    @torch.no_grad()
    def drop_gradients(self) -> None:
        """Every rank calls it once per optimizer step, after backward (a collective)."""
        import torch.distributed as dist

        from swiftlm.distributed.env import collective_device

        if not self.modules:
            return
        ran = torch.tensor(self.ran, dtype=torch.float32, device=collective_device())
        dist.all_reduce(ran, op=dist.ReduceOp.MAX)
        self.ran = [False] * len(self.modules)
        for module, flag in zip(self.modules, ran.tolist(), strict=True):
            if not flag:
                for param in module.parameters(recurse=False):
                    param.grad = None


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


def find_block_lists(model: nn.Module, skip=()) -> list[nn.ModuleList]:
    """The lists of transformer blocks: the outermost ModuleLists of same-class modules.

    Models keep them at different paths (model.layers, transformer.h, ...), and peft adds a
    prefix; their shape finds them all. Lists nested inside a block (such as MoE experts,
    which ranks run unevenly) stay part of that block's unit, and so do lists inside the
    modules of `skip`.
    """
    found: list[nn.ModuleList] = []
    inside: set[int] = {id(m) for module in skip for m in module.modules()}
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
