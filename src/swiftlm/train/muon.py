"""Muon for the hidden weight matrices, AdamW for everything else, as one optimizer.

Muon's authors (Jordan et al. 2024; Moonshot's "Muon is Scalable for LLM Training") apply it
to the 2-D weights of the hidden layers only: the token embeddings and the LM head are lookup
tables and a classifier, not linear maps between hidden states, and 1-D parameters (norms,
biases) have no matrix to orthogonalize; those train with AdamW. torch.optim.Muon refuses
anything but 2-D parameters, so the split is also what it accepts.

`MuonWithAdamW` is a real `torch.optim.Optimizer` over the param groups of both: the loop
steps and zero_grads it, the LR scheduler drives every group's rate, and its `state_dict()` is
torch's index-keyed one over all parameters, so every checkpoint format saves and reloads it
as it does AdamW's. Both inner optimizers read the same group dicts and the same state dict.
"""

import torch

# Muon's update is scaled by 0.2 * sqrt(max(rows, cols)) so that its RMS matches AdamW's:
# one --learning_rate and --weight_decay serve both halves (Moonshot's recipe).
MUON_LR_ADJUSTMENT = "match_rms_adamw"


def embedding_parameter_ids(model: torch.nn.Module) -> set[int]:
    """ids of the input embeddings' and the LM head's weights (tied or not), found on the
    Hugging Face model inside any wrapper (DDP, peft)."""
    found = set()
    for module in model.modules():
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            try:
                layer = getattr(module, getter)() if hasattr(module, getter) else None
            except (AttributeError, NotImplementedError):  # models without one
                layer = None
            weight = getattr(layer, "weight", None)
            if isinstance(weight, torch.Tensor):
                found.add(id(weight))
    return found


def split_for_muon(model: torch.nn.Module) -> tuple[list, list]:
    """(trainable parameters Muon updates: 2-D and not an embedding or the LM head, the rest)."""
    embeddings = embedding_parameter_ids(model)
    muon, rest = [], []
    for param in model.parameters():
        if param.requires_grad:
            hidden_matrix = param.ndim == 2 and id(param) not in embeddings
            (muon if hidden_matrix else rest).append(param)
    return muon, rest


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over `muon_groups`, torch.optim.AdamW over `adamw_groups`."""

    # Its param_groups are slices shared with the two inner optimizers: a group added to the
    # outer list reaches neither (tuners/lora_plus.split_b_groups leaves it alone).
    owns_inner_groups = True

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], muon: dict, adamw: dict):
        inner = []
        if muon_groups:
            inner.append(torch.optim.Muon(muon_groups, **muon))
        if adamw_groups:
            inner.append(torch.optim.AdamW(adamw_groups, **adamw))
        # The inner optimizers filled each group with their own defaults; the same dicts
        # become this optimizer's groups, so a rate the scheduler sets reaches both.
        super().__init__([g for opt in inner for g in opt.param_groups], defaults={})
        self.inner = inner
        self._share_groups_and_state()

    def _share_groups_and_state(self) -> None:
        start = 0
        for opt in self.inner:
            opt.param_groups = self.param_groups[start : start + len(opt.param_groups)]
            opt.state = self.state  # keyed by parameter, which the two never share
            start += len(opt.param_groups)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.inner:
            opt.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        # torch's loader replaces `param_groups` and `state` with new objects: share them again.
        super().load_state_dict(state_dict)
        self._share_groups_and_state()
