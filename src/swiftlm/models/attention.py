"""Attention for packed rows without wasted work.

A packed row (several samples, position ids restarting at 0 for each) needs attention that
never crosses samples. transformers' SDPA path builds a block-diagonal [T, T] mask for it,
which is correct but computes every masked block: four 300-token samples in one row cost
(4 x 300)^2 scores instead of 4 x 300^2. `swiftlm_varlen` runs causal SDPA on each sample's
slice instead (the CPU analogue of flash-attention's varlen kernel) and falls back to plain
SDPA for rows that are not packed, so evaluation and generation are unchanged.

A segment whose positions start at p > 0 is a *fork*: it continues the first p tokens of the
row's latest segment that starts at 0 (its root), attending to them and then causally to
itself. GRPO lays a prompt's completions out so (`[prompt + c1][c2][c3]...`, each c_i at the
positions after the prompt): the prompt is computed once for all of them. Rows without forks
(all of SFT's and DPO's) are untouched; a segment at p > 0 with no root of p tokens before it
(padding under odd positions) is attended on its own, as before.

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


def segment_prefixes(
    position_ids: torch.Tensor, bounds: list[list[tuple[int, int]]]
) -> list[list[tuple[int, int]]]:
    """Per row and segment, (root start, shared length): the root tokens a fork attends to
    before itself ((0, 0) for a segment of its own; see the module docstring). `position_ids`
    on the host."""
    prefixes = []
    for b, row_bounds in enumerate(bounds):
        root, row = None, []
        for start, end in row_bounds:
            first = int(position_ids[b, start])
            if first == 0:
                root = (start, end)
            shares = first > 0 and root is not None and root[1] - root[0] >= first
            row.append((root[0], first) if shares else (0, 0))
        prefixes.append(row)
    return prefixes


def _segment_attention(module, query, key, value, start, end, prefix, **kwargs):
    """One segment's attention [1, length, heads, D]: causal over itself, after the `prefix`
    (root start, length) of root tokens it continues."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    root, shared = prefix
    q = query[:, :, start:end]
    if not shared:
        k, v = key[:, :, start:end], value[:, :, start:end]
        return sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)[0]
    k = torch.cat([key[:, :, root : root + shared], key[:, :, start:end]], dim=2)
    v = torch.cat([value[:, :, root : root + shared], value[:, :, start:end]], dim=2)
    length = end - start
    own = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    seen = torch.ones(length, shared, dtype=torch.bool, device=query.device)
    mask = torch.cat([seen, own], dim=1)[None, None]
    return sdpa_attention_forward(module, q, k, v, mask, is_causal=False, **kwargs)[0]


def varlen_sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers attention interface: (module, q, k, v [B, heads, T, D], mask, ...) ->
    (output [B, T, heads, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.pop("position_ids", None)
    packed = position_ids is not None and query.shape[2] == key.shape[2] and query.shape[2] > 1
    host = position_ids.cpu() if packed else None  # one device sync per layer
    bounds = segment_bounds(host) if packed else None
    if bounds is None or all(len(row) == 1 for row in bounds):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    prefixes = segment_prefixes(host, bounds)
    rows = []
    for b, (row_bounds, row_prefixes) in enumerate(zip(bounds, prefixes, strict=True)):
        q, k, v = query[b : b + 1], key[b : b + 1], value[b : b + 1]
        pieces = [
            _segment_attention(module, q, k, v, start, end, prefix, **kwargs)
            for (start, end), prefix in zip(row_bounds, row_prefixes, strict=True)
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
