"""Turn encoded samples into micro-batch tensors, for any token-aligned columns.

A method names its token-aligned columns and their pad values (`{"input_ids": pad_id,
"labels": IGNORE_INDEX, ...}`); every such column is laid out the same way. Two layouts:
- padded: one sample per row, right-padded, with an `attention_mask` (the default);
- packed: several samples per row (`--packing`) or all samples in one row (`--padding_free`).
  Rows carry `position_ids` that restart at 0 for every sample and no attention mask: the
  attention implementation reads the sample boundaries from the restarts (transformers'
  SDPA/eager build a block-diagonal causal mask from them, flash-attention and swiftlm's
  varlen SDPA run each sample separately). `token_mask` marks real tokens for counting only.
Integer pad values give int64 tensors, float pad values float32 ones.
"""

import torch

from swiftlm.data.encode import IGNORE_INDEX

# Columns whose first position of every packed sample is set to the pad value: a sample's
# first label would be the target of the previous sample's last token.
SHIFTED_TARGETS = ("labels",)


def lm_pads(pad_token_id: int) -> dict[str, int]:
    """The token columns of a causal-LM sample: ids padded with the pad token, labels ignored."""
    return {"input_ids": pad_token_id, "labels": IGNORE_INDEX}


def _dtype(pad: int | float) -> torch.dtype:
    return torch.float32 if isinstance(pad, float) else torch.long


def collate(
    samples: list[dict], pad_token_id: int, pads: dict[str, int | float] | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad every token column to the longest sample; padding has attention 0."""
    pads = pads or lm_pads(pad_token_id)
    width = max(len(s["input_ids"]) for s in samples)
    batch = {
        name: torch.full((len(samples), width), pad, dtype=_dtype(pad))
        for name, pad in pads.items()
    }
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        for name, pad in pads.items():
            batch[name][row, :n] = torch.tensor(sample[name], dtype=_dtype(pad))
        attention_mask[row, :n] = 1
    return {**batch, "attention_mask": attention_mask}


def _packed_row(samples: list[dict], pads: dict) -> tuple[dict[str, list], list[int]]:
    columns: dict[str, list] = {name: [] for name in pads}
    positions: list[int] = []
    for sample in samples:
        for name, pad in pads.items():
            values = sample[name]
            columns[name] += [pad, *values[1:]] if name in SHIFTED_TARGETS else values
        positions += range(len(sample["input_ids"]))
    return columns, positions


def collate_packed(
    rows: list[list[dict]], pad_token_id: int, pads: dict[str, int | float] | None = None
) -> dict[str, torch.Tensor]:
    """Rows of concatenated samples with restarting position ids, right-padded.

    The padding of a short row gets its own positions 0, 1, ... so it reads as one more
    (label-free) sample that no real token can attend to.
    """
    pads = pads or lm_pads(pad_token_id)
    packed = [_packed_row(samples, pads) for samples in rows]
    width = max(len(positions) for _, positions in packed)
    batch = {
        name: torch.full((len(rows), width), pad, dtype=_dtype(pad)) for name, pad in pads.items()
    }
    position_ids = torch.arange(width, dtype=torch.long).repeat(len(rows), 1)
    token_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (columns, positions) in enumerate(packed):
        n = len(positions)
        for name, pad in pads.items():
            batch[name][r, :n] = torch.tensor(columns[name], dtype=_dtype(pad))
        position_ids[r, :n] = torch.tensor(positions, dtype=torch.long)
        position_ids[r, n:] = torch.arange(width - n, dtype=torch.long)
        token_mask[r, :n] = 1
    return {**batch, "position_ids": position_ids, "token_mask": token_mask}


def count_input_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Real (non-padding) tokens of a batch in either layout."""
    mask = batch.get("attention_mask", batch.get("token_mask"))
    return int(mask.sum())


# Batch entries that are a vision-language model's image inputs carry this prefix (the
# processor's own names after it: "image_inputs.pixel_values" ...), see data.vision_batch.
IMAGE_INPUTS = "image_inputs."


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch entries a causal LM's forward takes (labels stay with the loss), and a
    vision-language model's image inputs."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    for key, value in batch.items():
        if key.startswith(IMAGE_INPUTS):
            inputs[key[len(IMAGE_INPUTS) :]] = value
    return inputs
