"""Turn encoded samples into micro-batch tensors.

Two layouts:
- padded: one sample per row, right-padded, with an `attention_mask` (the default);
- packed: several samples per row (`--packing`) or all samples in one row (`--padding_free`).
  Rows carry `position_ids` that restart at 0 for every sample and no attention mask: the
  attention implementation reads the sample boundaries from the restarts (transformers'
  SDPA/eager build a block-diagonal causal mask from them, flash-attention and swiftlm's
  varlen SDPA run each sample separately). `token_mask` marks real tokens for counting only.
"""

import torch

from swiftlm.data.encode import IGNORE_INDEX


def collate(samples: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample; padding has attention 0 and label IGNORE_INDEX."""
    width = max(len(s["input_ids"]) for s in samples)
    input_ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        input_ids[row, :n] = torch.tensor(sample["input_ids"], dtype=torch.long)
        labels[row, :n] = torch.tensor(sample["labels"], dtype=torch.long)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def _packed_row(samples: list[dict]) -> tuple[list[int], list[int], list[int]]:
    ids, labels, positions = [], [], []
    for sample in samples:
        ids += sample["input_ids"]
        # A sample's first label would be the target of the previous sample's last token:
        # masking it keeps samples independent (unpacked, the shift drops it anyway).
        labels += [IGNORE_INDEX, *sample["labels"][1:]]
        positions += range(len(sample["input_ids"]))
    return ids, labels, positions


def collate_packed(rows: list[list[dict]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Rows of concatenated samples with restarting position ids, right-padded.

    The padding of a short row gets its own positions 0, 1, ... so it reads as one more
    (label-free) sample that no real token can attend to.
    """
    packed = [_packed_row(samples) for samples in rows]
    width = max(len(ids) for ids, _, _ in packed)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.arange(width, dtype=torch.long).repeat(len(rows), 1)
    token_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (ids, row_labels, positions) in enumerate(packed):
        n = len(ids)
        input_ids[r, :n] = torch.tensor(ids, dtype=torch.long)
        labels[r, :n] = torch.tensor(row_labels, dtype=torch.long)
        position_ids[r, :n] = torch.tensor(positions, dtype=torch.long)
        position_ids[r, n:] = torch.arange(width - n, dtype=torch.long)
        token_mask[r, :n] = 1
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "token_mask": token_mask,
    }


def count_input_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Real (non-padding) tokens of a batch in either layout."""
    mask = batch.get("attention_mask", batch.get("token_mask"))
    return int(mask.sum())


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch entries a causal LM's forward takes (labels stay with the loss)."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
