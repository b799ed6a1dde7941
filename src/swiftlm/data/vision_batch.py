"""A sample's image features: stored as one safetensors blob per sample, merged per batch
laid out like the batch's token rows (one sample per row, or several when packed).

The processor's outputs besides `input_ids`/`attention_mask` (`pixel_values`,
`image_grid_thw`, `pixel_attention_mask`, `mm_token_type_ids` ...) are kept together as the
`vision` column of the tokenized-data cache: safetensors bytes (no pickle), read back
exactly. A text-only sample has an empty blob. Merging a micro-batch follows the model's own
batching, in the order of the image tokens the features fill:
- token-aligned features (`mm_token_type_ids`) are concatenated along each row like
  `input_ids` (pad values for a text-only sample's tokens) and right-padded;
- features laid out [row, image, ...] (Idefics3/SmolVLM: `pixel_values`,
  `pixel_attention_mask`) put the images of a row's samples one after another and pad the
  rows with zero images, which those models drop;
- every other feature (an image's pixels, Qwen2-VL's patches and grids) is concatenated along
  its first axis in row-major order, the order in which the model scatters image features
  into the image tokens.
"""

from __future__ import annotations

import numpy as np
import torch

VISION_COLUMN = "vision"
# Processor outputs aligned with the tokens (one value per token), and their pad value.
TOKEN_ALIGNED = {"mm_token_type_ids": 0, "token_type_ids": 0}
# Processor outputs that are the text itself (the token columns hold them).
TEXT_OUTPUTS = ("input_ids", "attention_mask")


def pack_features(features: dict[str, np.ndarray]) -> bytes:
    """safetensors bytes of a sample's features ({} -> b"")."""
    if not features:
        return b""
    from safetensors.numpy import save

    return save({name: np.ascontiguousarray(value) for name, value in features.items()})


def unpack_features(blob: bytes) -> dict[str, torch.Tensor]:
    if not blob:
        return {}
    from safetensors.torch import load

    return load(bytes(blob))


def cut_token_features(features: dict[str, np.ndarray], keep: slice) -> dict[str, np.ndarray]:
    """The features of a truncated sample: token-aligned ones cut like its tokens."""
    return {
        name: value[..., keep] if name in TOKEN_ALIGNED else value
        for name, value in features.items()
    }


def collate_image_features(
    rows: list[list[dict]], width: int, per_sample_axis: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """Model inputs from the feature blobs (data.vision_batch) of each row's encoded samples,
    rows of `width` tokens."""
    unpacked = [[unpack_features(sample[VISION_COLUMN]) for sample in row] for row in rows]
    names = sorted({name for row in unpacked for features in row for name in features})
    batch = {}
    for name in names:
        per_row = [[f[name] for f in row if name in f] for row in unpacked]
        if name in TOKEN_ALIGNED:
            pad = TOKEN_ALIGNED[name]
            # a sample without this feature (text only) holds pad values for its tokens
            per_row = [
                [
                    f.get(name, torch.full((len(s["input_ids"]),), pad))
                    for f, s in zip(fs, row, strict=True)
                ]
                for fs, row in zip(unpacked, rows, strict=True)
            ]
            batch[name] = _token_rows(per_row, width, pad)
        elif name in per_sample_axis:
            batch[name] = _image_rows(per_row)
        else:
            batch[name] = torch.cat([value for row in per_row for value in row])
    return batch


def _token_rows(per_row: list[list[torch.Tensor]], width: int, pad: int) -> torch.Tensor:
    out = torch.full((len(per_row), width), pad, dtype=torch.long)
    for index, values in enumerate(per_row):
        if values:
            flat = torch.cat([value.reshape(-1) for value in values])
            out[index, : flat.numel()] = flat
    return out


def _image_rows(per_row: list[list[torch.Tensor]]) -> torch.Tensor:
    """[row, image, ...]: each sample's [1, images, ...] joined along the image axis."""
    joined = [torch.cat([v[0] for v in values]) if values else None for values in per_row]
    shaped = next(j for j in joined if j is not None)
    most = max(j.shape[0] if j is not None else 0 for j in joined)
    out = torch.zeros((len(joined), most, *shaped.shape[1:]), dtype=shaped.dtype)
    for index, images in enumerate(joined):
        if images is not None:
            out[index, : images.shape[0]] = images
    return out


def features_of(sample: dict) -> dict[str, torch.Tensor]:
    """The unpacked features of one encoded sample (for tests and debugging)."""
    return unpack_features(sample.get(VISION_COLUMN, b""))
