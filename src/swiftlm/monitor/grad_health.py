"""Gradient health by layer: norms at every log line, histograms now and then, and where a
non-finite gradient or activation first appeared.

Parameters are grouped by the layer they belong to, from input to output: `embed`,
`layers.0` ... `layers.N` (decoder blocks, whatever the architecture calls them), `norm`,
`lm_head` (or a reward model's `score`), and `other`. A vanishing gradient shows as norms
falling towards the input; an exploding one as a group whose norm jumps.

Distributed layouts: a plain gradient is the same on every rank that holds it (DDP replicas
after the all-reduce, a pipeline stage's replicas), so its group's square is combined with MAX
over ranks; a DTensor gradient (FSDP2 shard, tensor-parallel split) holds a part, so its
squares are SUMMED, each divided by how many ranks hold that same part (replicated mesh
dimensions). One all-reduce per kind per log line.
"""

import math
import re

import torch
import torch.distributed as dist

# Decoder blocks under the names transformers' architectures give them (Llama `layers`, GPT-2
# `h`, T5/Bloom `block`/`blocks`, BERT `layer`).
_BLOCK = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|layer)\.(\d+)(?:\.|$)")
_EMBED = ("embed", "wte", "wpe", "word_embeddings")
_HEAD = ("lm_head", "score", "classifier")
# Histograms are of log10|gradient|: the orders of magnitude, where vanishing and exploding
# gradients show. Zeros land in the lowest bin.
HIST_EDGES = [float(x) for x in torch.linspace(-12, 2, 57).tolist()]


def layer_group(name: str) -> str:
    """The layer a parameter belongs to, from its qualified name."""
    block = _BLOCK.search(name)
    if block:
        return f"layers.{block.group(1)}"
    if any(part in name for part in _EMBED):
        return "embed"
    if any(part in name for part in _HEAD):
        return "lm_head" if "lm_head" in name else "score"
    if "norm" in name or ".ln_f." in name:
        return "norm"
    return "other"


def _order(group: str) -> tuple[int, int]:
    """Input to output."""
    if group.startswith("layers."):
        return 1, int(group.split(".")[1])
    return {"embed": (0, 0), "norm": (2, 0), "lm_head": (3, 0), "score": (3, 0)}.get(group, (4, 0))


def _replication(grad: torch.Tensor) -> int:
    """How many ranks hold the same values as this DTensor's local part."""
    from torch.distributed.tensor import Replicate

    mesh = grad.device_mesh
    return math.prod(
        mesh.size(i) for i, p in enumerate(grad.placements) if isinstance(p, Replicate)
    )


class GradientHealth:
    """Per-layer gradient figures of one model. Build after the strategy wrapped it."""

    def __init__(self, model: torch.nn.Module):
        self.params = [
            (n, p, layer_group(n)) for n, p in model.named_parameters() if p.requires_grad
        ]
        local = sorted({g for _, _, g in self.params}, key=_order)
        # Every rank must reduce the same vector: pipeline stages hold different layers.
        self.groups = sorted(set().union(*_gather(local)), key=_order)
        self.index = {g: i for i, g in enumerate(self.groups)}

    @torch.no_grad()
    def layer_norms(self) -> dict[str, float]:
        """{group: L2 norm of its gradients} over the whole model, on every rank."""
        from torch.distributed.tensor import DTensor

        # Squares stay on the device until one copy at the end: no sync per parameter.
        plain: list[list[torch.Tensor]] = [[] for _ in self.groups]
        sharded: list[list[torch.Tensor]] = [[] for _ in self.groups]
        for _, param, group in self.params:
            grad = param.grad
            if grad is None:
                continue
            at = self.index[group]
            if isinstance(grad, DTensor):
                square = grad.to_local().detach().float().pow(2).sum()
                sharded[at].append(square / _replication(grad))
            else:
                plain[at].append(grad.detach().float().pow(2).sum())
        plain_sums, sharded_sums = _sums(plain), _sums(sharded)
        if dist.is_initialized() and dist.get_world_size() > 1:
            plain_sums = _reduce(plain_sums, dist.ReduceOp.MAX)
            sharded_sums = _reduce(sharded_sums, dist.ReduceOp.SUM)
        norms = (plain_sums + sharded_sums).sqrt().tolist()
        return {g: round(n, 6) for g, n in zip(self.groups, norms, strict=True)}

    @torch.no_grad()
    def histograms(self) -> dict[str, list[int]]:
        """{group: counts of log10|gradient| over HIST_EDGES}, of this rank's gradients."""
        low, high, bins = HIST_EDGES[0], HIST_EDGES[-1], len(HIST_EDGES) - 1
        counts: dict[str, torch.Tensor] = {}
        for _, param, group in self.params:
            grad = _local(param.grad)
            if grad is None:
                continue
            magnitude = grad.detach().float().abs().clamp_min(10**low).log10().clamp(low, high)
            hist = torch.histc(magnitude.flatten().cpu(), bins=bins, min=low, max=high)
            counts[group] = counts[group] + hist if group in counts else hist
        return {g: [int(c) for c in counts[g].tolist()] for g in self.groups if g in counts}

    @torch.no_grad()
    def first_nonfinite_gradient(self) -> str | None:
        """The parameter nearest the output whose gradient is not finite: backward runs from
        the output, so that is where the gradient first went bad."""
        for name, param, _ in reversed(self.params):
            grad = _local(param.grad)
            if grad is not None and not bool(torch.isfinite(grad).all()):
                return name
        return None


def _local(grad):
    from torch.distributed.tensor import DTensor

    return grad.to_local() if isinstance(grad, DTensor) else grad


def _gather(local: list[str]) -> list[list[str]]:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [local]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return everyone


def _sums(per_group: list[list[torch.Tensor]]) -> torch.Tensor:
    """One float64 CPU vector of the per-group sums."""
    sums = [torch.stack(parts).sum().double() if parts else None for parts in per_group]
    device = next((s.device for s in sums if s is not None), torch.device("cpu"))
    zero = torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([zero if s is None else s.to(device) for s in sums]).cpu()


def _reduce(values: torch.Tensor, op) -> torch.Tensor:
    # NCCL reduces CUDA tensors only; gloo CPU ones.
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    moved = values.to(device)
    dist.all_reduce(moved, op=op)
    return moved.cpu()
