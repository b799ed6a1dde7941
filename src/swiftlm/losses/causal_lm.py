"""Pure loss functions. A loss returns a SUM over tokens plus the token count, so the loop
can normalize by the label tokens of a whole optimizer step (all micro-batches), which
makes gradient accumulation exact: 4 x batch 1 equals 1 x batch 4."""

import torch
import torch.nn.functional as F

from swiftlm.data.collate import model_inputs
from swiftlm.data.encode import IGNORE_INDEX


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Token t predicts token t+1: drop the first label, pad the end with IGNORE_INDEX."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def count_label_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry loss (after the shift)."""
    return int((shifted_labels(labels) != IGNORE_INDEX).sum())


def token_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over label tokens (float32 for stable sums)."""
    targets = shifted_labels(labels).reshape(-1)
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        targets,
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def causal_lm_loss(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """loss_fn(model, batch) -> (sum of token losses, metrics) for SFT and pre-training."""
    # No KV cache: with one, transformers ignores the sample boundaries of packed rows.
    logits = model(**model_inputs(batch), use_cache=False).logits
    loss_sum = token_cross_entropy_sum(logits, batch["labels"])
    return loss_sum, {}
