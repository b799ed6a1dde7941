"""Mixture-of-experts models: how their experts run, what their routers did, and the router's
auxiliary loss.

transformers (5.x) stores each MoE layer's experts as stacked 3-D weights (`gate_up_proj`
[experts, 2 x width, hidden], `down_proj` [experts, hidden, width]) and runs them through an
*experts implementation* chosen at load (`--experts_impl`, ms-swift's flag):

- `grouped_mm`, transformers' default: the (token, expert) pairs sorted by expert and one
  grouped GEMM over them (`torch._grouped_mm`; on CPU a loop of GEMMs inside one operator,
  with its own backward). swiftlm measured nothing faster on CPU (docs/moe.md).
- `batched_mm`: each pair gathers its expert's weights and one batched matmul runs them;
  memory grows with tokens x expert size (the ~90M model of benchmarks/moe.py runs out of
  23 GiB at 2,048 tokens). Meant for short decode batches on GPU.
- `eager`: the modeling file's Python loop over experts with one-hot masks.

All three are dropless: every token reaches its top-k experts, none is dropped for capacity.

The routers are found where transformers declares them: each MoE model's
`_can_record_outputs["router_logits"]` names its router class and the output holding the
logits. `RouterRecorder` hooks those modules while the training loss runs and reduces what
they saw to the figures logged as router health and to the load-balancing loss.
"""

import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swiftlm.errors import ConfigError


def router_source(model: torch.nn.Module):
    """transformers' declaration of where `model`'s router logits come from (an
    OutputRecorder: router class and output index), or None for a dense model."""
    for module in model.modules():
        recorder = getattr(type(module), "_can_record_outputs", None) or {}
        if "router_logits" in recorder:
            return recorder["router_logits"]
    return None


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router modules of an MoE model, input side first; [] for a dense model."""
    source = router_source(model)
    if source is None:
        return []
    return [m for m in model.modules() if isinstance(m, source.target_class)]


def is_moe(model: torch.nn.Module) -> bool:
    return bool(routers(model))


def experts_per_token(config) -> tuple[int, int]:
    """(experts per MoE layer, experts each token is routed to) from a model config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    names = ("num_experts", "num_local_experts", "n_routed_experts")
    experts = next((getattr(text, n) for n in names if getattr(text, n, None)), 0)
    return int(experts), int(getattr(text, "num_experts_per_tok", 0) or 0)


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The stacked-expert modules (transformers' `@use_experts_implementation` classes)."""
    # By class: a peft ParamWrapper around the experts forwards attribute reads to them.
    return [m for m in model.modules() if hasattr(type(m), "_apply_gate")]


def use_experts_implementation(model: torch.nn.Module, name: str) -> None:
    """Run `model`'s experts with implementation `name` (a `--experts_impl` value); a dense
    model is left as it is (transformers refuses to set one on it)."""
    if expert_modules(model):
        model.set_experts_implementation(name)


def expert_parameters(model: torch.nn.Module) -> tuple[int, int, int]:
    """(all expert weights, the share of them one token uses, of which trainable): the
    per-token work of the experts is top_k / experts of their weights."""
    experts, top_k = experts_per_token(model.config) if hasattr(model, "config") else (0, 0)
    weights = [p for m in expert_modules(model) if experts for p in m.parameters(recurse=False)]
    total = sum(p.numel() for p in weights)
    trained = sum(p.numel() for p in weights if p.requires_grad)
    return total, total * top_k // max(experts, 1), trained * top_k // max(experts, 1)


@dataclass
class RouterStats:
    """What the routers did over one loss call's tokens (padding excluded), all on device.

    aux: the load-balancing loss as transformers defines it (Switch Transformer's: experts x
    sum over experts of the share of routed slots times the mean router probability, over
    all MoE layers' tokens together); differentiable through the probabilities.
    z_loss: mean squared log-sum-exp of the router logits (ST-MoE), logged only.
    entropy: mean entropy of the router's distribution over experts, in nats.
    counts: [layers, experts] slots routed to each expert.
    """

    aux: torch.Tensor
    z_loss: torch.Tensor
    entropy: torch.Tensor
    counts: torch.Tensor


def router_statistics(logits: torch.Tensor, top_k: int) -> RouterStats:
    """`logits`: [layers, tokens, experts] router logits of the real tokens."""
    layers, tokens, experts = logits.shape
    logits = logits.float()
    log_probs = F.log_softmax(logits, dim=-1)
    probs = log_probs.exp()
    chosen = probs.topk(top_k, dim=-1).indices.reshape(layers, -1)
    counts = torch.zeros(layers, experts, device=logits.device).scatter_add_(
        1, chosen, torch.ones_like(chosen, dtype=torch.float32)
    )
    routed_share = counts.sum(0) / max(layers * tokens, 1)  # top-k slots per token: sums to k
    aux = experts * (routed_share * probs.mean(dim=(0, 1))).sum()
    return RouterStats(
        aux=aux,
        z_loss=torch.logsumexp(logits, dim=-1).square().mean(),
        entropy=-(probs * log_probs).sum(-1).mean(),
        counts=counts,
    )


def _layer_name(model: torch.nn.Module, router: torch.nn.Module) -> str:
    """`layer 3` for the router of decoder layer 3 (dense layers have none)."""
    path = next(name for name, module in model.named_modules() if module is router)
    found = re.search(r"layers\.(\d+)\.", path)
    return f"layer {found.group(1)}" if found else path


class RouterRecorder:
    """Hooks on an MoE model's routers. Inside `recording()`, every forward that builds a
    graph (the policy's; not a no-grad reference, a generation or a recomputation in the
    backward of gradient checkpointing) adds its router logits; `take()` reduces them.

    Padding is left out: the decoder's 2-D `attention_mask` of the same call says which
    tokens are real (packed rows have none, every token is real)."""

    def __init__(self, model: torch.nn.Module, top_k: int):
        self.top_k, self.armed = top_k, False
        self.index = router_source(model).index
        self.calls: list[tuple[list[torch.Tensor], torch.Tensor | None]] = []
        found = routers(model)
        self.layer_names = [_layer_name(model, r) for r in found]
        self._handles = [r.register_forward_hook(self._router_output) for r in found]
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        self._handles.append(
            decoder.register_forward_pre_hook(self._decoder_input, with_kwargs=True)
        )

    def _decoder_input(self, module, args, kwargs) -> None:
        if self.armed and torch.is_grad_enabled():
            mask = kwargs.get("attention_mask")
            usable = isinstance(mask, torch.Tensor) and mask.dim() == 2
            self.calls.append(([], mask.reshape(-1).bool() if usable else None))

    def _router_output(self, module, args, output) -> None:
        if self.armed and torch.is_grad_enabled() and self.calls:
            self.calls[-1][0].append(output[self.index] if isinstance(output, tuple) else output)

    @contextmanager
    def recording(self):
        self.calls, self.armed = [], True
        try:
            yield self
        finally:
            self.armed = False

    def take(self) -> RouterStats | None:
        """The statistics of what was recorded (None if no routed forward ran), then forget it."""
        calls, self.calls = [c for c in self.calls if c[0]], []
        if not calls:
            return None
        per_call = []
        for layer_logits, mask in calls:
            stacked = torch.stack(layer_logits)  # [layers, tokens, experts]
            if mask is not None and mask.numel() == stacked.shape[1]:
                stacked = stacked[:, mask.to(stacked.device)]
            per_call.append(stacked)
        return router_statistics(torch.cat(per_call, dim=1), self.top_k)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def build_router_recorder(
    model: torch.nn.Module, aux_loss_coef: float, pipeline_parallel: bool, model_name: str
) -> RouterRecorder | None:
    """The recorder of an MoE model's routers (None for a dense model or under pipeline
    parallelism, whose schedule runs the forwards); --router_aux_loss_coef is refused where
    it cannot apply."""
    flag = f"--router_aux_loss_coef {aux_loss_coef}"
    if not is_moe(model):
        if aux_loss_coef:
            raise ConfigError(f"{flag}: {model_name} has no mixture-of-experts routers; drop it")
        return None
    if pipeline_parallel:
        if aux_loss_coef:
            raise ConfigError(
                f"{flag}: the pipeline schedule runs the forwards, where the router loss is not "
                "added; drop the flag or --pipeline_parallel_size"
            )
        return None
    if aux_loss_coef and not hasattr(model.config, "router_aux_loss_coef"):
        raise ConfigError(
            f"{flag}: {model_name} ({model.config.model_type}) defines no load-balancing loss "
            "in transformers (its routers balance otherwise, e.g. by a bias); drop the flag"
        )
    return RouterRecorder(model, experts_per_token(model.config)[1])


def describe_moe(model: torch.nn.Module) -> str:
    """One log line: experts, routing and the experts implementation of an MoE model."""
    experts, top_k = experts_per_token(model.config)
    total, active, _ = expert_parameters(model)
    implementation = getattr(model.config, "_experts_implementation", None) or "eager"
    return (
        f"mixture of experts: {len(routers(model))} routed layers, {experts} experts, top "
        f"{top_k}; expert weights {total:,} ({active:,} used per token); experts run "
        f"{implementation}"
    )
