"""Attention masks for models with sliding-window layers (Mistral, Qwen2 with
`use_sliding_window`, Gemma 2/3's mixed layers), in the engine's batch layout.

transformers' own sliding-window mask counts the window in cache columns. In the engine's
batch cache a row's columns are not always its positions: left padding keeps a row's tokens
contiguous (there the two agree), but a row whose prefix came from the prefix cache has
masked columns between its prefix and its rest, and a window counted in columns would lose
the tokens before them. So the window is applied on each row's token positions (its real
columns, counted): a query at position p sees the keys at positions p - window + 1 .. p, as
the model was trained. The batch cache keeps every column (nothing is evicted at the
window), so a sequence may grow past the window; sliding layers simply stop seeing the old
columns.
"""

import torch
from transformers.masking_utils import create_causal_mask

from swiftlm.engine.kvcache import CACHE_KEYWORD


def sliding_window(config) -> int | None:
    """The window of the model's sliding-window layers, None when it has none."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if "sliding_attention" in types else None
    return window if getattr(config, "use_sliding_window", True) else None


class WindowMasks:
    """Builds the `attention_mask` argument of one forward: a mask per layer type for models
    that take one (`layer_types`), else one 4D mask for every layer (Mistral)."""

    def __init__(self, config, window: int):
        self.config = config
        self.window = window
        self.per_layer_type = getattr(config, "layer_types", None) is not None

    def __call__(self, padding: torch.Tensor, query_length: int, cache, dtype) -> object:
        """`padding`: the batch's [rows, columns] mask, the new columns included; `cache`:
        the batch cache before the forward adds them."""
        positions = (padding.cumsum(dim=1) - 1).clamp(min=0)
        window = self.window

        def within_window(batch_idx, head_idx, q_idx, kv_idx):
            return positions[batch_idx, q_idx] - positions[batch_idx, kv_idx] < window

        # Only the shape, dtype and device of the embeddings are read.
        shape = torch.empty((padding.shape[0], query_length, 1), dtype=dtype, device=padding.device)
        arguments = dict(
            config=self.config, inputs_embeds=shape, attention_mask=padding,
            allow_is_causal_skip=False, **{CACHE_KEYWORD: cache},
        )  # fmt: skip
        sliding = create_causal_mask(**arguments, and_mask_function=within_window)
        if not self.per_layer_type:
            return sliding
        return {"full_attention": create_causal_mask(**arguments), "sliding_attention": sliding}
