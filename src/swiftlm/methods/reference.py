"""The frozen reference model of DPO and KTO, in one of three forms:

- LoRA (any adapter tuner): the policy itself with its adapter disabled (peft's
  `disable_adapter()`), so no second copy of the base weights is held;
- full fine-tuning: a frozen deep copy of the policy taken before training (and before a
  resumed run loads its checkpoint, so it is the initial model in both cases);
- `--ref_model PATH`: that model, loaded frozen in the policy's weight dtype on its device.
  It must share the policy's tokenizer: the answers' token ids are scored by both, so a
  different vocabulary size is refused before any weight loads.
"""

import contextlib
import copy

import torch

from swiftlm.errors import ConfigError
from swiftlm.models.sequence_group import share_sequence_group


class Reference:
    """Holds the frozen reference (or nothing, for LoRA without --ref_model)."""

    def __init__(self, cfg, method: str):
        self.method = method
        self.uses_lora = cfg.tuner.train_type != "full"
        self.path = cfg.rlhf.ref_model
        self.attn_impl = cfg.model.attn_impl
        self.model: torch.nn.Module | None = None

    def prepare(self, model: torch.nn.Module, log) -> None:
        """Build the reference for `model` (the loaded, tuned policy, not yet wrapped)."""
        if self.path:
            # The policy's attention (a packed layout's varlen kernel), which may differ from
            # --attn_impl: the reference reads the same rows.
            attention = attention_of(model) or self.attn_impl
            self.model = load_reference(self.path, model, attention)
            log(f"{self.method}: reference = --ref_model {self.path} (frozen)")
        elif self.uses_lora:
            log(f"{self.method}: reference = the base model with the adapter disabled (no copy)")
        else:
            self.model = copy.deepcopy(model).eval().requires_grad_(False)
            log(f"{self.method}: reference = a frozen copy of the initial model (full fine-tuning)")

    def module(self, model: torch.nn.Module):
        """(the module to run, its context): the frozen model, or the policy without adapter."""
        if self.model is not None:
            share_sequence_group(model, self.model)  # it reads the policy's shards
            return self.model, contextlib.nullcontext()
        policy = unwrapped(model)
        return policy, policy.disable_adapter()

    def free(self) -> None:
        """Drop the reference weights (after --precompute_ref_log_probs)."""
        self.model = None


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP / DeepSpeed wrappers (they hold it as `.module`)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def attention_of(model: torch.nn.Module) -> str | None:
    """The attention implementation a (possibly wrapped) model runs with."""
    return getattr(unwrapped(model).config, "_attn_implementation", None)


def load_reference(path: str, policy: torch.nn.Module, attn_impl: str) -> torch.nn.Module:
    """`--ref_model`: loaded frozen in the policy's weight dtype, on the policy's device."""
    from transformers import AutoConfig

    from swiftlm.models.loader import load_model, resolve_model

    resolved = resolve_model(path).path
    ref_vocab = AutoConfig.from_pretrained(resolved).vocab_size
    vocab = unwrapped(policy).config.vocab_size
    if ref_vocab != vocab:
        raise ConfigError(
            f"--ref_model {path}: its vocabulary has {ref_vocab} tokens, the policy's (--model) "
            f"{vocab}; the reference scores the policy's token ids, so it needs the same "
            "tokenizer: pass a reference of the same model family, or drop --ref_model"
        )
    embeddings = unwrapped(policy).get_input_embeddings().weight
    device, dtype = embeddings.device, embeddings.dtype
    return load_model(resolved, dtype, device, attn_impl).eval().requires_grad_(False)
