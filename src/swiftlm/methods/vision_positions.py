"""Position ids of packed rows for Qwen2-VL's multimodal rotary embedding (M-RoPE).

In a packed row every sample restarts its positions at 0. For a text model that is all; for
Qwen2-VL an image's tokens take 3-D (temporal, height, width) positions and the text after an
image continues from the image's extent, so each sample's positions are computed by the
model's own `get_rope_index` on that sample alone. The model takes them as one [4, rows,
width] tensor: the restarting text positions first (from which transformers builds the
per-sample causal mask), then the three M-RoPE axes.
"""

from __future__ import annotations

import torch

from swiftlm.data.collate import IMAGE_INPUTS

TOKEN_TYPES = IMAGE_INPUTS + "mm_token_type_ids"
GRIDS = IMAGE_INPUTS + "image_grid_thw"


def rope_index_owner(model: torch.nn.Module):
    """The submodule with `get_rope_index` (Qwen2-VL's inner model), through any wrapper."""
    for module in model.modules():
        if callable(getattr(module, "get_rope_index", None)):
            return module
    raise ValueError("the model has no get_rope_index: it is not a Qwen2-VL model")


def packed_mrope_positions(owner, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[4, rows, width] position ids of a packed batch (restarting `position_ids`)."""
    text = batch["position_ids"]
    types = batch[TOKEN_TYPES]
    grids = batch.get(GRIDS)
    mrope = text.unsqueeze(0).repeat(3, 1, 1)
    used = 0
    for row in range(text.shape[0]):
        starts = (text[row] == 0).nonzero().flatten().tolist() + [text.shape[1]]
        for start, end in zip(starts[:-1], starts[1:], strict=True):
            segment = types[row, start:end]
            images = int(((segment == 1) & (_previous(segment) != 1)).sum())
            if not images:
                continue  # text only: the three axes are the text positions
            positions, _ = owner.get_rope_index(
                batch["input_ids"][row : row + 1, start:end],
                segment.unsqueeze(0),
                image_grid_thw=grids[used : used + images],
            )
            mrope[:, row, start:end] = positions[:, 0]
            used += images
    return torch.cat([text.unsqueeze(0), mrope])


def _previous(values: torch.Tensor) -> torch.Tensor:
    """The value before each position (-1 before the first)."""
    return torch.cat([values.new_full((1,), -1), values[:-1]])
