"""Which sequence-parallel group a model's attention runs over, for code that only holds the
model: a loss that needs whole sequences' sums, a reference model that reads the policy's
shards.

distributed/sequence_parallel.py installs the group on each attention module (as
`SEQUENCE_GROUP`) when it makes the attention Ulysses or ring; a model without it is not
sequence parallel.
"""

import torch

from swiftlm.errors import ConfigError

SEQUENCE_GROUP = "sequence_parallel_group"


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in model.modules() if hasattr(module, SEQUENCE_GROUP)]


def sequence_group(model: torch.nn.Module):
    """The sequence-parallel group of `model`'s attention (through DDP's and peft's
    wrappers, which hold it as a submodule), or None."""
    found = _attention_modules(model)
    return getattr(found[0], SEQUENCE_GROUP) if found else None


def sum_over_shards(model: torch.nn.Module, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sequence sums (log-probs, label counts) of this rank's shard -> the whole
    sequences', summed over `model`'s sequence-parallel group; unchanged without one.

    Differentiable: the backward sums the group's gradients, so each shard's tokens receive
    the gradient of the loss that every rank computes from the same sums (the loss is
    weighted on the group's first shard alone: sequence_parallel.shard_sequence's `owned`)."""
    group = sequence_group(model)
    if group is None:
        return tensors
    from torch.distributed._functional_collectives import all_reduce, wait_tensor

    # torch registers this collective's backward as the same sum over the group.
    return tuple(wait_tensor(all_reduce(tensor, "sum", group)) for tensor in tensors)


def share_sequence_group(policy: torch.nn.Module, other: torch.nn.Module) -> None:
    """Run `other` (a frozen reference model of the same architecture, which reads the
    policy's shards) with the policy's sequence-parallel attention; nothing without one."""
    group = sequence_group(policy)
    if group is None or sequence_group(other) is group:
        return
    attention = _attention_modules(policy)[0]
    others = [module for module in other.modules() if type(module) is type(attention)]
    if not others:
        raise ConfigError(
            f"--sequence_parallel_size: the reference model has no {type(attention).__name__} "
            "layers to run over the policy's sequence shards; use a reference of the policy's "
            "architecture (--ref_model) or drop --sequence_parallel_size"
        )
    for module in others:
        setattr(module, SEQUENCE_GROUP, group)
    other.config._attn_implementation = attention.config._attn_implementation
