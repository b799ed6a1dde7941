"""LoRA+ (Hayou et al., 2024; ms-swift's --lorap_lr_ratio): the B matrices train at a higher
learning rate than the A matrices, `ratio` x --learning_rate, which the paper shows speeds up
feature learning in wide models (it proposes ratio 16).

The optimizer builder turns the groups into torch param groups, each at its multiplier x the
learning rate; the schedule then scales every group alike, so the ratio holds at each step.
Everything besides B (A, DoRA's magnitudes, modules trained in full) keeps --learning_rate, as
in peft's `create_loraplus_optimizer` with its embedding learning rate left at the default.
"""

from typing import NamedTuple

import torch

# peft's names of LoRA's B matrices (Linear and Embedding layers).
B_MATRICES = ("lora_B", "lora_embedding_B")


class ParamGroup(NamedTuple):
    """Trainable parameters that share a learning rate: `lr_scale` x --learning_rate."""

    name: str
    params: list[torch.nn.Parameter]
    lr_scale: float


def tuner_param_groups(model: torch.nn.Module, lorap_lr_ratio: float | None) -> list[ParamGroup]:
    """The trainable parameters of `model` as learning-rate groups: one group at 1.0 without
    LoRA+, else `default` at 1.0 and `lora_B` at `lorap_lr_ratio` (empty groups left out).
    Tied parameters are listed once, in `named_parameters` order."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if lorap_lr_ratio is None:
        return [ParamGroup("default", [p for _, p in trainable], 1.0)]
    b_params = [p for n, p in trainable if any(f".{b}." in f".{n}." for b in B_MATRICES)]
    b_ids = {id(p) for p in b_params}
    groups = [
        ParamGroup("default", [p for _, p in trainable if id(p) not in b_ids], 1.0),
        ParamGroup("lora_B", b_params, lorap_lr_ratio),
    ]
    return [group for group in groups if group.params]


def split_b_groups(model: torch.nn.Module, optimizer, ratio: float) -> bool:
    """Put the LoRA B matrices of each of `optimizer`'s param groups in a group of their own
    at `ratio` x that group's learning rate (its other settings, weight decay included, kept),
    in place, before any step and before the schedule reads the rates. Returns False for an
    optimizer that keeps its groups elsewhere (Muon's pair of inner optimizers), left alone."""
    if getattr(optimizer, "owns_inner_groups", False):
        return False
    b_ids = {id(p) for p in tuner_param_groups(model, ratio)[-1].params}
    added = []
    for group in optimizer.param_groups:
        b_params = [p for p in group["params"] if id(p) in b_ids]
        if not b_params:
            continue
        group["params"] = [p for p in group["params"] if id(p) not in b_ids]
        added.append({**group, "params": b_params, "lr": group["lr"] * ratio})
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]] + added
    return True
