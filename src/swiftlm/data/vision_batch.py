"""A sample's image features: stored as one safetensors blob per sample, merged per batch.

The processor's outputs besides `input_ids`/`attention_mask` (`pixel_values`,
`image_grid_thw`, `pixel_attention_mask`, `mm_token_type_ids` ...) are kept together as the
`vision` column of the tokenized-data cache: safetensors bytes (no pickle), read back
exactly. A text-only sample has an empty blob. Merging a micro-batch follows the model's own
batching: token-aligned features are right-padded like `input_ids`; features that pad every
sample to the same number of images (Idefics3/SmolVLM) are padded with zero images, which
those models drop; every other feature is concatenated along its first axis (images, or
patches for Qwen2-VL).
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


def collate_features(
    blobs: list[bytes], width: int, per_sample_axis: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """The model inputs of a micro-batch's image features (rows padded to `width` tokens).

    `per_sample_axis`: the features laid out [sample, image, ...] (models.vision)."""
    unpacked = [unpack_features(blob) for blob in blobs]
    names = sorted({name for features in unpacked for name in features})
    batch = {}
    for name in names:
        values = [features.get(name) for features in unpacked]
        if name in TOKEN_ALIGNED:
            batch[name] = _pad_tokens(values, width, TOKEN_ALIGNED[name])
        elif name in per_sample_axis:
            batch[name] = _pad_images(values)
        else:
            batch[name] = torch.cat([v for v in values if v is not None])
    return batch


def _pad_tokens(values: list, width: int, pad: int) -> torch.Tensor:
    rows = torch.full((len(values), width), pad, dtype=torch.long)
    for row, value in enumerate(values):
        if value is not None:
            flat = value.reshape(-1)
            rows[row, : flat.numel()] = flat
    return rows


def _pad_images(values: list) -> torch.Tensor:
    """[sample, image, ...] features of every sample, padded with zero images (a sample
    without images gets only padding)."""
    shaped = next(v for v in values if v is not None)
    most = max(v.shape[1] if v is not None else 0 for v in values)
    out = torch.zeros((len(values), max(most, 1), *shaped.shape[2:]), dtype=shaped.dtype)
    for row, value in enumerate(values):
        if value is not None:
            out[row, : value.shape[1]] = value[0]
    return out


def features_of(sample: dict) -> dict[str, torch.Tensor]:
    """The unpacked features of one encoded sample (for tests and debugging)."""
    return unpack_features(sample.get(VISION_COLUMN, b""))
