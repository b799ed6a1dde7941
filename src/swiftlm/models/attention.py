"""Attention for packed rows without wasted work.

A packed row (several samples, position ids restarting at 0 for each) needs attention that
never crosses samples. transformers' SDPA path builds a block-diagonal [T, T] mask for it,
which is correct but computes every masked block: four 300-token samples in one row cost
(4 x 300)^2 scores instead of 4 x 300^2. `swiftlm_varlen` runs causal SDPA on each sample's
slice instead (the CPU analogue of flash-attention's varlen kernel) and falls back to plain
SDPA for rows that are not packed, so evaluation and generation are unchanged.

On CUDA with flash-attn installed, `flash_attention_2` does the same natively from the
position ids; `training_attention` picks it.
"""

import importlib.util

import torch

VARLEN = "swiftlm_varlen"


def segment_bounds(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) of each sample: a sample starts where the position does not
    continue the previous one."""
    previous = torch.nn.functional.pad(position_ids[:, :-1] + 1, (1, 0), value=-1)
    starts = (position_ids != previous).cpu()
    width = position_ids.shape[1]
    bounds = []
    for row in starts:
        cuts = row.nonzero().flatten().tolist() + [width]
        bounds.append(list(zip(cuts[:-1], cuts[1:], strict=True)))
    return bounds


def varlen_sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers attention interface: (module, q, k, v [B, heads, T, D], mask, ...) ->
    (output [B, T, heads, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.pop("position_ids", None)
    packed = position_ids is not None and query.shape[2] == key.shape[2] and query.shape[2] > 1
    bounds = segment_bounds(position_ids) if packed else None
    if bounds is None or all(len(row) == 1 for row in bounds):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows = []
    for b, row_bounds in enumerate(bounds):
        pieces = [
            sdpa_attention_forward(
                module,
                query[b : b + 1, :, start:end],
                key[b : b + 1, :, start:end],
                value[b : b + 1, :, start:end],
                None,
                is_causal=True,
                **kwargs,
            )[0]
            for start, end in row_bounds
        ]
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0), None


def register_varlen_attention() -> None:
    """Make `swiftlm_varlen` a valid attn_implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN, varlen_sdpa_attention)
    # Unpacked batches still need SDPA's padding mask.
    AttentionMaskInterface.register(VARLEN, sdpa_mask)


def flash_attention_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None


def _windowed(config, max_length: int) -> bool:
    """Sliding-window attention that a --max_length row can exceed (Mistral-style)."""
    window = getattr(config, "sliding_window", None)
    return bool(window) and getattr(config, "use_sliding_window", True) and window < max_length


def training_attention(
    requested: str, device: torch.device, packed: bool, config=None, max_length: int = 0
) -> str:
    """The attention implementation to train with: packed rows get a varlen kernel.

    Models whose sliding window is shorter than a row keep SDPA with transformers' packed
    mask, which applies the window; the per-sample kernel here would not."""
    if not packed or requested != "sdpa" or _windowed(config, max_length):
        return requested
    if flash_attention_available(device):
        return "flash_attention_2"
    register_varlen_attention()
    return VARLEN
