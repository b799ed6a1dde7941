"""Pad encoded samples into a micro-batch."""

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
