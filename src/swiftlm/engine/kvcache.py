"""The running batch's KV cache: left-padded rows in preallocated per-layer buffers.

Every row of the batch shares one column axis; a row that started later (shorter) has
padding columns on its left, masked out by `mask`. Decoding writes one column per step in
place (no `torch.cat` of the whole cache per step, as `DynamicLayer` does); rows join by
`merge` (right-aligned, so every row's newest token is in the last column) and leave by
`select`, which also drops leading columns that only padding uses. A speculative step
writes several columns per row and keeps each row's accepted ones (`keep_new_columns`): a row
that accepted fewer than another has masked columns after its tokens, which its position ids
skip as they skip left padding.

Every layer keeps every column; sliding-window layers see only their window through their
mask (`windows.py`), so their old columns are kept, not evicted.
"""

import inspect

import torch
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import create_causal_mask

GROWTH = 64  # columns added when a buffer is full: amortizes the copy over many steps
# What this transformers calls the KV cache argument of a model's forward and of its mask
# builders: `cache` since 5.20, `past_key_values` before. A forward given the other name
# takes it into **kwargs and runs without the cache: every decode step would see only its
# own token, silently (vLLM's CPU build pins transformers < 5.20, so both are in use).
CACHE_KEYWORD = (
    "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
)


class SlotLayer(DynamicLayer):
    """One layer's keys and values, [rows, heads, capacity, head_dim], `length` columns used."""

    def __init__(self):
        super().__init__()
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        shape = (*key_states.shape[:2], 0, key_states.shape[-1])
        self.keys = key_states.new_zeros(shape)
        self.values = value_states.new_zeros((*shape[:3], value_states.shape[-1]))
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        added = key_states.shape[-2]
        if self.length + added > self.keys.shape[-2]:
            self._grow(self.length + added + GROWTH)
        end = self.length + added
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _grow(self, capacity: int) -> None:
        self.keys = _resized(self.keys, self.length, capacity)
        self.values = _resized(self.values, self.length, capacity)

    def get_seq_length(self) -> int:
        return self.length

    def truncate(self, length: int) -> None:
        """Forget the columns from `length` on (their buffer space is reused)."""
        self.length = min(self.length, length)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def used(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def take(self, rows: torch.Tensor, start: int) -> None:
        """Keep `rows` and the columns from `start` on, copied once into a new buffer."""
        kept = self.length - start
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty((len(rows), old.shape[1], kept + GROWTH, old.shape[-1]))
            torch.index_select(old[:, :, start : self.length], 0, rows, out=new[:, :, :kept])
            setattr(self, name, new)
        self.length = kept

    def stack(self, other: "SlotLayer", length: int) -> None:
        """Our rows, then `other`'s, right-aligned on `length` columns, zeros on the left
        (masked out, but they must be finite: 0 x NaN would still be NaN)."""
        rows = self.keys.shape[0]
        for name in ("keys", "values"):
            mine, theirs = getattr(self, name), getattr(other, name)
            shape = (rows + theirs.shape[0], mine.shape[1], length + GROWTH, mine.shape[-1])
            new = mine.new_zeros(shape)
            new[:rows, :, length - self.length : length] = mine[:, :, : self.length]
            new[rows:, :, length - other.length : length] = theirs[:, :, : other.length]
            setattr(self, name, new)
        self.length = length

    def replace(self, keys: torch.Tensor, values: torch.Tensor, headroom: int = GROWTH) -> None:
        """Hold exactly `keys`/`values` (all columns used), with room for `headroom` more."""
        self.length = keys.shape[-2]
        self.keys = _resized(keys, self.length, self.length + headroom)
        self.values = _resized(values, self.length, self.length + headroom)
        self.device = keys.device
        self.is_initialized = True


def _resized(buffer: torch.Tensor, used: int, capacity: int) -> torch.Tensor:
    out = buffer.new_empty((*buffer.shape[:2], capacity, buffer.shape[-1]))
    out[:, :, :used] = buffer[:, :, :used]
    return out


class BatchKV:
    """A `Cache` for the model plus the 2D padding mask of its columns."""

    def __init__(self, num_layers: int, rows: int, device: torch.device):
        self.cache = Cache(layers=[SlotLayer() for _ in range(num_layers)])
        self.mask = torch.zeros((rows, 0), dtype=torch.long, device=device)

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def layers(self) -> list[SlotLayer]:
        return self.cache.layers

    def extend_mask(self, columns: torch.Tensor) -> torch.Tensor:
        """The attention mask for a forward that adds `columns` ([rows, k], 1 = real)."""
        self.mask = torch.cat([self.mask, columns.to(self.mask)], dim=1)
        return self.mask

    def keep_new_columns(self, added: int, kept: list[int]) -> None:
        """After a forward that added `added` columns to every row, keep only the first
        `kept[i]` of them for row i (speculative decoding: the columns of its accepted draft
        tokens). The rest of a row's are masked out; columns that no row keeps are dropped."""
        start = self.length - added
        keep = torch.arange(added).unsqueeze(0) < torch.tensor(kept).unsqueeze(1)
        self.mask[:, start:] *= keep.to(self.mask)
        length = start + max(kept)
        self.mask = self.mask[:, :length]
        for layer in self.layers():
            layer.truncate(length)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices), then drop leading columns no kept row uses."""
        rows = rows.to(self.mask.device)
        mask = self.mask.index_select(0, rows)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else mask.shape[1]
        self.mask = mask[:, start:]
        for layer in self.layers():
            if layer.is_initialized:
                layer.take(rows, start)

    def repeat_rows(self, repeats: torch.Tensor) -> None:
        """Row i becomes `repeats[i]` identical rows (the n samples of one prompt)."""
        repeats = repeats.to(self.mask.device)
        self.mask = self.mask.repeat_interleave(repeats, dim=0)
        for layer in self.layers():
            keys, values = layer.used()
            layer.replace(
                keys.repeat_interleave(repeats, dim=0), values.repeat_interleave(repeats, dim=0)
            )

    def merge(self, other: "BatchKV") -> None:
        """Append `other`'s rows below ours, right-aligned on a common column count."""
        if self.rows == 0:
            self.cache, self.mask = other.cache, other.mask
            return
        length = max(self.length, other.length)
        self.mask = torch.cat([_left_pad(self.mask, length), _left_pad(other.mask, length)])
        for mine, theirs in zip(self.layers(), other.layers(), strict=True):
            mine.stack(theirs, length)


def _left_pad(tensor: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
