"""Gradient steps every strategy shares: backward, postponing the data-parallel reduction,
the global gradient norm, clipping and the optimizer step.

One norm function serves every layout: plain gradients (one process, DDP replicas, a stage's
replicas), DTensor gradients (FSDP2 shards, tensor-parallel splits: their norm is reduced over
their mesh) and pipeline stages (each holds different parameters: the squares of the stages'
norms are summed over the pipeline group).
"""

import math
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from swiftlm.distributed.env import collective_device


def backward(loss: torch.Tensor, last_micro_batch: bool) -> None:
    loss.backward()


def gradient_sync(model, sync: bool):
    """Reduce gradients over data-parallel ranks only when `sync` (the step's last
    micro-batch); earlier micro-batches accumulate locally."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, DistributedDataParallel):
        return nullcontext() if sync else model.no_sync()
    if isinstance(model, FSDPModule):
        return _fsdp_gradient_sync(model, sync)
    return nullcontext()  # nothing reduces gradients over ranks


@contextmanager
def _fsdp_gradient_sync(model, sync: bool):
    # Without sync, gradients accumulate unsharded on each rank; the last micro-batch
    # reduce-scatters the sum.
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _layout(grad: torch.Tensor):
    from torch.distributed.tensor import DTensor

    if isinstance(grad, DTensor):
        return grad.device_mesh, tuple(grad.placements)
    return None


@torch.no_grad()
def global_grad_norm(grads: list[torch.Tensor], pp_group=None) -> torch.Tensor:
    """The L2 norm of all gradients of the model, as a plain (local) tensor on every rank."""
    from torch.distributed.tensor import DTensor

    by_layout: dict = {}
    for grad in grads:  # gradients of one layout reduce together: one collective each
        by_layout.setdefault(_layout(grad), []).append(grad)
    norms = []
    for members in by_layout.values():
        norm = torch.nn.utils.get_total_norm(members)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1 and pp_group is None:
        return norms[0]
    device = norms[0].device if norms else collective_device()
    squares = sum((n.to(device, torch.float64) ** 2 for n in norms), torch.zeros((), device=device))
    if pp_group is not None:  # each stage holds different parameters
        squares = squares.to(collective_device(), torch.float64)
        dist.all_reduce(squares, group=pp_group)
    return squares.sqrt().to(device, torch.float32)


@torch.no_grad()
def clip_grad_norm(params, max_norm: float, pp_group=None) -> float:
    """Scale the gradients to a global norm of at most `max_norm`; return the norm before."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    total = global_grad_norm(grads, pp_group)
    # torch's own coefficient (max_norm / (norm + 1e-6), at most 1), applied on the device:
    # no wait for the norm before the gradients are scaled. A sharded (DTensor) gradient is
    # scaled through its local shard: a plain tensor may not meet a DTensor in one op.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local.mul_(coef.to(local.device))
    return float(total)  # the step's one read of it: it decides the update and is logged


def clip_then_step(params, optimizer, max_norm: float, scaler, pp_group=None) -> float:
    """Unscale (fp16), clip, and step unless the gradient is non-finite; return the pre-clip
    norm (not finite: the step was skipped)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = clip_grad_norm(params, max_norm, pp_group)
    if scaler is not None:
        scaler.step(optimizer)  # GradScaler skips the update itself on inf/nan and lowers its scale
        scaler.update()
    elif math.isfinite(norm):
        optimizer.step()
    return norm
