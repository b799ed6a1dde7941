"""Weights that `save_pretrained` wrote under other names than the live model's: transformers
(5.x) converts some weights when it saves, e.g. a mixture-of-experts layer's stacked experts
(`experts.gate_up_proj` [experts, 2 x width, hidden]) into one tensor per expert and
projection (`experts.0.gate_proj.weight`, ... or Mixtral's `experts.0.w1.weight`), the layout
of the models on the hub. `from_pretrained` converts them back; a checkpoint resume loads a
folder into the live model itself, so it needs the same conversion.

transformers' own reverse conversion (the one `save_pretrained` applies) is reused: run on a
tensor of element indices instead of the weights, it says where each element of every saved
tensor sits in the model's tensor. Those conversions only move elements (split, stack,
concatenate), so each index must come out exactly once; anything else is refused.
"""

import torch

from swiftlm.errors import CheckpointError


def to_model_names(model, weights: dict[str, torch.Tensor], missing: list[str]) -> dict:
    """`weights` (a folder's tensors, by saved name) with the saved parts of each `missing`
    model tensor assembled under its model name; the parts are dropped from the result. A
    missing tensor that no conversion produces is left missing."""
    from transformers.core_model_loading import revert_weight_conversion

    params = dict(model.state_dict())
    converted = dict(weights)
    for name in missing:
        live = params[name]
        index = torch.arange(live.numel()).view(live.shape)
        parts = revert_weight_conversion(model, {name: index})
        if list(parts) == [name] or not all(part in converted for part in parts):
            continue  # not saved under other names (or not in this folder)
        converted[name] = _assemble(
            name, live, {part: converted.pop(part) for part in parts}, parts
        )
    return converted


def _assemble(name: str, live: torch.Tensor, saved: dict, positions: dict) -> torch.Tensor:
    """The model tensor `name` from its saved parts, each element placed at its position."""
    flat = torch.empty(live.numel(), dtype=live.dtype)
    covered = torch.zeros(live.numel(), dtype=torch.int32)
    for part, where in positions.items():
        if where.dtype != torch.int64 or saved[part].shape != where.shape:
            raise CheckpointError(f"{name}: the saved {part} does not convert back to the model")
        flat[where.reshape(-1)] = saved[part].reshape(-1).to(live.dtype)
        covered[where.reshape(-1)] += 1
    if not bool((covered == 1).all()):
        raise CheckpointError(f"{name}: its saved parts do not cover it exactly once")
    return flat.view(live.shape)
