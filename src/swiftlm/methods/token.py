"""The pieces SFT and pre-training share: causal-LM batches and the token cross-entropy.

Both methods train next-token prediction on label tokens; they differ only in what they read
and how they encode it. Methods call these functions rather than inherit them, so each
method module still reads top to bottom.
"""

import torch

from swiftlm.data.collate import collate, collate_packed, lm_pads
from swiftlm.data.encode import IGNORE_INDEX
from swiftlm.losses.causal_lm import causal_lm_loss, count_label_tokens, token_cross_entropy_sum
from swiftlm.losses.fused_ce import fused_causal_lm_loss, install_fused_lm_head
from swiftlm.methods.base import Batch, Layout, LossOutput


def collate_tokens(layout: Layout, pad_token_id: int) -> Batch:
    """input_ids/labels in the layout the loop's plan chose."""
    if layout.packed:
        return collate_packed(layout.rows, pad_token_id)
    return collate([row[0] for row in layout.rows], pad_token_id)


def label_tokens(batch: Batch) -> float:
    """Tokens that carry loss after the shift: the normalizer of a token-mean loss."""
    return float(count_label_tokens(batch["labels"]))


def token_lengths(sample: dict) -> int:
    return len(sample["input_ids"])


def without_labels(sample: dict) -> dict:
    """A copy that adds nothing to the loss or the label-token count."""
    return {**sample, "labels": [IGNORE_INDEX] * len(sample["labels"])}


class TokenLoss:
    """Sum of next-token cross-entropy over label tokens, fused with the LM head when the
    model allows it (`--fused_cross_entropy`), else from the model's logits."""

    def __init__(self, fused: bool):
        self.wants_fused = fused
        self.fused = False

    def prepare_model(self, model, log) -> None:
        """Install the fused head on the model (before any wrapper) when asked and possible."""
        if not self.wants_fused:
            return
        self.fused = install_fused_lm_head(model)
        if not self.fused:
            log(
                "--fused_cross_entropy: the output layer is not a plain Linear; using the plain loss"
            )

    def __call__(self, model: torch.nn.Module, batch: Batch) -> LossOutput:
        if self.fused:
            return fused_causal_lm_loss(model, batch)
        return causal_lm_loss(model, batch)

    @staticmethod
    def from_logits(logits: torch.Tensor, batch: Batch) -> LossOutput:
        return token_cross_entropy_sum(logits, batch["labels"]), {}


def token_pads(pad_token_id: int) -> dict[str, int | float]:
    return {**lm_pads(pad_token_id), "attention_mask": 0}
