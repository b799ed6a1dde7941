"""Pipeline stages of a causal LM: which blocks each rank holds, and the module holding them.

Each stage holds a contiguous run of decoder blocks, the first also the embeddings, the last
the final norm and LM head. A stage is built from the model the tuner produced (a peft
model's blocks carry their adapters), so its parameters are the model's own objects and
`names` maps them back to the model's parameter names for saving. How the stages are
scheduled, fed and saved is the strategy's (pp.py).
"""

import torch
from torch import nn

from swiftlm.errors import ConfigError


class DecoderStage(nn.Module):
    """Blocks [start, end) of a causal LM, plus the embeddings (first) or head (last).

    Input: token ids (first stage) or hidden states; output: hidden states, or logits (last).
    """

    def __init__(self, causal_lm, start: int, end: int, first: bool, last: bool):
        super().__init__()
        inner = causal_lm.get_decoder()
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[start:end])
        self.rotary_emb = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.lm_head = causal_lm.lm_head if last else None
        # A bound method, not a submodule: the full model's parameters stay out of the stage.
        self._enable_checkpointing = causal_lm.gradient_checkpointing_enable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.rotary_emb(hidden, positions)
        # No attention mask: batches are right-padded, so causal attention never lets a real
        # token see padding, and the padding itself carries no labels.
        for layer in self.layers:
            hidden = layer(hidden, position_ids=positions, position_embeddings=rotary)
        if self.lm_head is None:
            return hidden
        return self.lm_head(self.norm(hidden))

    def get_decoder(self) -> nn.Module:
        return self  # its `layers` are the blocks parallelize works on

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        """transformers' per-block switch, set through the model the blocks come from."""
        self._enable_checkpointing(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)


def stage_bounds(num_layers: int, stages: int, index: int) -> tuple[int, int]:
    """Blocks of stage `index`: as even as possible, earlier stages taking the extra ones."""
    base, extra = divmod(num_layers, stages)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def build_stage(model, index: int, stages: int) -> tuple[DecoderStage, dict[str, str]]:
    """Stage `index` of `stages` from a causal LM or a peft model around one, and
    {stage parameter name: the model's parameter name}."""
    causal_lm = model.get_base_model() if hasattr(model, "peft_config") else model
    if getattr(causal_lm.config, "tie_word_embeddings", False):
        raise ConfigError(
            "--pipeline_parallel_size: this model ties its input embeddings to its LM head, "
            "which would sit on different stages; use fsdp2 or deepspeed for it"
        )
    layers = causal_lm.get_decoder().layers
    if len(layers) < stages:
        raise ConfigError(f"--pipeline_parallel_size {stages} exceeds the {len(layers)} blocks")
    start, end = stage_bounds(len(layers), stages, index)
    stage = DecoderStage(causal_lm, start, end, first=index == 0, last=index == stages - 1)
    full_names = {id(p): name for name, p in model.named_parameters()}
    return stage, {name: full_names[id(p)] for name, p in stage.named_parameters()}
