"""Next-token prediction on label tokens: the batches and loss that SFT and pre-training share.

Both methods differ only in what they read and how they encode it; everything from encoded
samples on is `NextTokenObjective`, which they extend with their `to_sample`, `encode` and
`cache_options`.
"""

import torch

from swiftlm.data.collate import collate, collate_packed, lm_pads, model_inputs
from swiftlm.data.encode import IGNORE_INDEX
from swiftlm.errors import ConfigError
from swiftlm.losses.causal_lm import (
    TOKEN_LOSSES,
    causal_lm_loss,
    registered_loss_sum,
    shifted_labels,
    token_cross_entropy_sum,
)
from swiftlm.losses.fused_ce import fused_causal_lm_loss, install_fused_lm_head
from swiftlm.methods.base import Batch, Layout, LossOutput, MethodDefaults


def token_pads(pad_token_id: int) -> dict[str, int | float]:
    """The token-aligned tensors of a padded causal-LM batch and their pad values."""
    return {**lm_pads(pad_token_id), "attention_mask": 0}


def token_lengths(sample: dict) -> int:
    return len(sample["input_ids"])


def without_labels(sample: dict) -> dict:
    """A copy that adds nothing to the loss or the label-token count."""
    return {**sample, "labels": [IGNORE_INDEX] * len(sample["labels"])}


class NextTokenObjective(MethodDefaults):
    """Sum of next-token cross-entropy over label tokens, normalized by the label tokens of
    the step; fused with the LM head when `--fused_cross_entropy` and the model allow it."""

    columns = ("input_ids", "labels")
    supports_packing = True

    def __init__(
        self,
        tokenizer,
        fused_cross_entropy: bool,
        loss_type: str | None = None,
        liger: bool = False,
    ):
        self.tokenizer = tokenizer
        self.token_pads = token_pads(tokenizer.pad_token_id)
        if loss_type is not None and loss_type not in TOKEN_LOSSES:
            known = ", ".join(TOKEN_LOSSES) or "no plugin registers one"
            raise ConfigError(
                f"--loss_type {loss_type}: not a registered loss ({known}); load the plugin "
                "that registers it (installed, or --external_plugins file.py)"
            )
        # A plugin's loss reads the logits: the fused head, which never makes them, is off.
        self.loss_type = loss_type
        self.wants_fused, self.fused = fused_cross_entropy and loss_type is None, False
        self.liger = liger  # --use_liger_kernel: the fused loss is Liger's

    length = staticmethod(token_lengths)
    masked = staticmethod(without_labels)

    def collate(self, layout: Layout) -> Batch:
        """input_ids/labels in the layout the loop's plan chose."""
        if layout.packed:
            return collate_packed(layout.rows, self.tokenizer.pad_token_id)
        return collate([row[0] for row in layout.rows], self.tokenizer.pad_token_id)

    @staticmethod
    def normalizer(batch: Batch) -> torch.Tensor:
        """Tokens that carry loss after the shift."""
        return (shifted_labels(batch["labels"]) != IGNORE_INDEX).sum()

    def prepare_model(self, model, log) -> None:
        """Install the fused head on the model (before any wrapper) when asked and possible."""
        if not self.wants_fused:
            return
        self.fused = install_fused_lm_head(model, liger=self.liger)
        if not self.fused:
            log(
                "--fused_cross_entropy: the output layer is not a plain Linear; using the plain loss"
            )

    def loss(self, model: torch.nn.Module, batch: Batch) -> LossOutput:
        if self.loss_type is not None:
            logits = model(**model_inputs(batch), use_cache=False).logits
            return registered_loss_sum(self.loss_type, logits, batch["labels"]), {}
        if self.fused:
            return fused_causal_lm_loss(model, batch)
        return causal_lm_loss(model, batch)

    def pipeline_loss(self, logits: torch.Tensor, batch: Batch) -> LossOutput:
        if self.loss_type is not None:
            return registered_loss_sum(self.loss_type, logits, batch["labels"]), {}
        return token_cross_entropy_sum(logits, batch["labels"]), {}
