"""Expert parallel (`--expert_parallel_size N`): every MoE layer's experts split over the N
ranks of an expert group, tokens sent to the rank that holds their expert and back.

Layout. "ep" is a split of the data-parallel dimension (distributed/mesh.py): the N ranks of
an expert group are data-parallel ranks that read different micro-batches, and each keeps the
contiguous slice [r * E/N, (r + 1) * E/N) of the E stacked experts of every layer (the first
dimension of `gate_up_proj`, `down_proj` and their biases). Everything else (attention, the
router, norms, embeddings) is kept in step over all data-parallel ranks by DDP (replicas) or
FSDP2 (shards), both told to leave the expert slices alone.

Dispatch and combine (transformers' `AllToAllEP`, written here for plain tensors: its EP plan
shards the weights as DTensors, which DDP cannot replicate and FSDP2 would shard again). The model's own router picks
each token's top-k experts; its experts module is called with (tokens, expert ids, weights) and
this rank then
  1. sorts the (token, expert) pairs by expert, which groups them by owner rank, and swaps the
     per-expert counts with the group (an all-to-all of N x E/N integers, read on the host);
  2. sends each pair's hidden state to its expert's rank (all-to-all with those split sizes);
  3. runs the received rows through the model's experts implementation (`--experts_impl`:
     grouped_mm, batched_mm or eager) on its local experts, top-1 with unit weights;
  4. sends the outputs back (the reverse all-to-all), puts them in the pairs' order and sums
     them per token, weighted by the router's weights.
Both all-to-alls are differentiable (`all_to_all_single_autograd`): backward sends the rows'
gradients to the experts and the experts' input gradients back, on gloo as on NCCL.

Gradients. The loop multiplies each rank's loss by the data-parallel ranks D over the step's
global normalizer, because DDP and FSDP2 average over D. An expert shard's gradient already sums the
contributions of the tokens its expert group sent it; summing it over the D/N ranks that hold
the same shard ("ep_replica") then covers all D ranks' tokens, and dividing by D gives the
gradient of the global mean loss, as for the other weights. `reduce_gradients` runs once per
optimizer step, after the last micro-batch. The
global gradient norm adds the shards' squares over the expert group to the replicas' squares.

Checkpoints. `gathered()` puts the full experts (and their optimizer moments) in place of the
shards for the time of a save or a load, so the run writes and reads the checkpoint of its
layout without expert parallel (DDP's replicated files; FSDP2's DCP state, where the full
experts are one replicated tensor each) and the final model (the full experts in the model
files), and each rank keeps only its slice afterwards: a resume is exact.
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import DTensor

from swiftlm.distributed.gradients import global_grad_norm
from swiftlm.errors import ConfigError
from swiftlm.models.moe import expert_modules, experts_per_token

FLAG = "--expert_parallel_size"


def check_expert_parallel(model: nn.Module, size: int) -> None:
    """Refuse, before anything is split, a model whose experts cannot be split `size` ways."""
    name = getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__
    found = expert_modules(model)
    if not found:
        raise ConfigError(
            f"{FLAG} {size} needs a mixture-of-experts model; {name} has no experts (no "
            f"stacked expert weights); drop {FLAG}"
        )
    experts = experts_per_token(model.config)[0] or found[0].num_experts
    if experts % size:
        raise ConfigError(
            f"{FLAG} {size}: {name} has {experts} experts per layer, which do not split into "
            f"{size} equal shards; use a size that divides {experts}"
        )
    if _lora_reaches_experts(model):
        raise ConfigError(
            f"{FLAG} {size} with LoRA on the stacked experts (peft target parameters): the "
            "adapters span every expert and cannot be split with them; use --train_type full, "
            "or attention-only adapters (--target_modules q_proj k_proj v_proj o_proj)"
        )


def _lora_reaches_experts(model: nn.Module) -> bool:
    configs = getattr(model, "peft_config", {}) or {}
    return any(getattr(config, "target_parameters", None) for config in configs.values())


def stacked_parameters(experts: nn.Module) -> list[nn.Parameter]:
    """The experts module's weights stacked over experts (first dimension = its experts)."""
    count = experts.num_experts
    return [p for p in experts.parameters(recurse=False) if p.dim() > 0 and p.shape[0] == count]


def apply_expert_parallel(model: nn.Module, ep_mesh) -> None:
    """Keep this rank's slice of every MoE layer's experts and route their tokens through the
    expert group (in place; parameter names stay as they were)."""
    rank, size = ep_mesh.get_local_rank(), ep_mesh.size()
    group = ep_mesh.get_group()
    for experts in expert_modules(model):
        local = experts.num_experts // size
        for param in stacked_parameters(experts):
            param.data = param.data[rank * local : (rank + 1) * local].clone()
        experts.num_experts = local  # what the experts implementations count their groups by
        weight = stacked_parameters(experts)[0]
        experts.forward = ExpertDispatch(experts.forward, local, group, size, weight)


class ExpertDispatch:
    """The experts' forward under expert parallel: (tokens, top-k expert ids, top-k weights)
    of this rank's micro-batch in, the weighted expert output per token out."""

    def __init__(self, local_forward, local_experts: int, group, size: int, weight):
        self.local_forward = local_forward  # the model's experts implementation, local ids
        self.local_experts, self.group, self.size = local_experts, group, size
        # FSDP2 gathers the other weights in the compute dtype on GPUs, not the expert shards
        # (it leaves them alone): the rows meet the shards in the shards' dtype.
        self.weight = weight

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        top_k = top_k_index.shape[-1]
        expert_ids = top_k_index.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)  # by expert, hence by owner rank
        sent_counts = torch.bincount(expert_ids, minlength=self.local_experts * self.size)
        sent_counts = sent_counts.view(self.size, self.local_experts)
        received_counts = torch.empty_like(sent_counts)
        dist.all_to_all_single(received_counts, sent_counts, group=self.group)
        sent, received = torch.stack([sent_counts.sum(1), received_counts.sum(1)]).tolist()
        rows = hidden_states[order // top_k].to(self.weight.dtype)
        rows = _exchange(rows, received, sent, self.group)
        outputs = self._run_local_experts(rows, received_counts)
        back = _exchange(outputs, sent, received, self.group)
        per_pair = torch.empty_like(back)
        per_pair[order] = back  # the pairs' own (token, slot) order
        per_pair = per_pair.view(*top_k_weights.shape, -1)
        combined = (per_pair * top_k_weights.unsqueeze(-1).to(per_pair.dtype)).sum(dim=1)
        return combined.to(hidden_states.dtype)

    def _run_local_experts(self, rows: torch.Tensor, received_counts: torch.Tensor):
        """The received rows through this rank's experts: sorted by sender, then by expert."""
        local_ids = torch.arange(self.local_experts, device=rows.device).repeat(self.size)
        local_ids = local_ids.repeat_interleave(received_counts.reshape(-1)).unsqueeze(-1)
        if rows.shape[0] == 0:
            # No token came: run one zero row, so the experts' weights stay in the graph and
            # backward makes the same collectives on every rank.
            zero = rows.sum(dim=0, keepdim=True) * 0
            ids = local_ids.new_zeros((1, 1))
            return self.local_forward(zero, ids, zero.new_ones((1, 1)))[:0]
        return self.local_forward(rows, local_ids, rows.new_ones(local_ids.shape))


def _exchange(rows: torch.Tensor, output_sizes: list, input_sizes: list, group) -> torch.Tensor:
    """A differentiable all-to-all of rows with per-rank split sizes (its backward is the
    reverse exchange)."""
    return funcol.wait_tensor(
        funcol.all_to_all_single_autograd(rows, output_sizes, input_sizes, group)
    )


def split_expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert shards, which DDP must not average nor FSDP2 shard: each rank holds
    different ones."""
    return [p for experts in expert_modules(model) for p in stacked_parameters(experts)]


@dataclass
class ExpertShards:
    """One rank's expert shards and the groups they are exchanged and reduced over."""

    parameters: list[nn.Parameter]
    ep_group: object  # the expert group: ranks holding different shards
    replica_group: object  # the ranks holding the same shard
    ep_rank: int
    ep_size: int
    replicas: int
    dp_size: int  # all data-parallel ranks, whose losses the loop scaled by dp_size

    @classmethod
    def of(cls, model: nn.Module, mesh, dp_size: int) -> "ExpertShards":
        ep, replica = mesh["ep"], mesh["ep_replica"]
        return cls(
            split_expert_parameters(model),
            ep.get_group(),
            replica.get_group(),
            ep.get_local_rank(),
            ep.size(),
            replica.size(),
            dp_size,
        )

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Sum each trained shard's gradient over its replicas and divide by dp_size (module
        docstring); every rank calls it once per optimizer step, after backward."""
        for param in self.parameters:
            if not param.requires_grad:
                continue
            if param.grad is None:  # keeps the collectives the same on every rank
                param.grad = torch.zeros_like(param)
            if self.replicas > 1:
                dist.all_reduce(param.grad, group=self.replica_group)
            param.grad.div_(self.dp_size)

    @torch.no_grad()
    def clip_grad_norm(self, params, max_norm: float) -> float:
        """Clip every gradient to a global norm of `max_norm`; return the norm before: the
        other gradients' (replicas, or FSDP2's shards: global_grad_norm) squared, plus the
        expert shards' squares summed over the expert group."""
        split = {id(p) for p in self.parameters}
        grads = [p.grad for p in params if p.grad is not None and id(p) not in split]
        shard_grads = [p.grad for p in self.parameters if p.grad is not None]
        replicated = global_grad_norm(grads)
        squares = replicated.double() ** 2
        if any(p.requires_grad for p in self.parameters):  # the same on every rank
            shards = global_grad_norm(shard_grads, pp_group=self.ep_group)
            squares = squares + shards.to(squares.device, torch.float64) ** 2
        total = squares.sqrt().float()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's own coefficient
        for grad in [*grads, *shard_grads]:
            local = grad.to_local() if isinstance(grad, DTensor) else grad  # FSDP2's shards
            local.mul_(coef.to(local.device))
        return float(total)

    def clip_then_step(self, params, optimizer, max_norm: float, scaler) -> float:
        """Reduce the shards' gradients, unscale (fp16), clip, and step unless the gradient is
        non-finite (gradients.clip_then_step, with the shards' norm)."""
        self.reduce_gradients()
        if scaler is not None:
            scaler.unscale_(optimizer)
        norm = self.clip_grad_norm(list(params), max_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        elif math.isfinite(norm):
            optimizer.step()
        return norm

    @contextmanager
    def gathered(self, optimizer=None) -> Iterator[None]:
        """Inside, every shard (and its optimizer moments) is the full stack of experts, the
        same on every rank; on leaving, each rank keeps its slice of what is there then (what
        a load put in). A collective: every rank of the expert group enters it."""
        state = optimizer.state if optimizer is not None else {}
        local = [p.shape[0] for p in self.parameters]
        for param in self.parameters:
            moments = state.get(param, {})
            for key, value in list(moments.items()):
                if torch.is_tensor(value) and value.shape == param.shape:
                    moments[key] = self._gather(value)
            param.data = self._gather(param.data)
        try:
            yield
        finally:
            state = optimizer.state if optimizer is not None else {}  # a load replaces it
            for param, count in zip(self.parameters, local, strict=True):
                full = param.shape
                param.data = self._slice(param.data, count)
                for key, value in list(state.get(param, {}).items()):
                    if torch.is_tensor(value) and value.shape == full:
                        state[param][key] = self._slice(value, count)

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.ep_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.ep_group)
        return torch.cat(parts)

    def _slice(self, tensor: torch.Tensor, count: int) -> torch.Tensor:
        return tensor[self.ep_rank * count : (self.ep_rank + 1) * count].clone()
