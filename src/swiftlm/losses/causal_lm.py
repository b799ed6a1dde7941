"""Pure loss functions. A loss returns a SUM over tokens plus the token count, so the loop
can normalize by the label tokens of a whole optimizer step (all micro-batches), which
makes gradient accumulation exact: 4 x batch 1 equals 1 x batch 4.

Methods that weight or group token losses (DPO-style preference losses, per-sample weights)
ask for `reduction="token"`: losses `[rows, width]` aligned with `shifted_labels`, which
`sequence_sums` adds up per sample of a padded or packed micro-batch, e.g.

    token_losses, _ = causal_lm_loss(model, batch, reduction="token")
    ids = sequence_ids_from_batch(batch)
    per_sample = sequence_sums(token_losses, ids, count_sequences(ids))
"""

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


# Token losses added by plugins (swiftlm.plugins.register_loss), chosen with --loss_type:
# name -> fn(logits [rows, width, vocab] float32, targets [rows, width]) -> the 0-d SUM of
# the losses at the target positions (targets already shifted: targets[:, t] is what
# logits[:, t] predicts; IGNORE_INDEX where no loss). The loop divides by the label tokens.
TOKEN_LOSSES: dict = {}


def registered_loss_sum(name: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The registered token loss `name` on a micro-batch's logits and (unshifted) labels."""
    loss_sum = TOKEN_LOSSES[name](logits.float(), shifted_labels(labels))
    if not isinstance(loss_sum, torch.Tensor) or loss_sum.dim() != 0:
        raise TypeError(
            f"--loss_type {name}: the loss must return a 0-d tensor (the sum over label tokens), "
            f"got {type(loss_sum).__name__}{getattr(loss_sum, 'shape', '')}"
        )
    return loss_sum


def causal_lm_loss(
    model, batch: dict[str, torch.Tensor], reduction: str = "sum"
) -> tuple[torch.Tensor, dict]:
    """loss_fn(model, batch) -> (sum of token losses, metrics) for SFT and pre-training;
    with reduction="token" the token losses themselves (see `token_cross_entropy`)."""
    check_reduction(reduction)
    # No KV cache: with one, transformers ignores the sample boundaries of packed rows.
    logits = model(**model_inputs(batch), use_cache=False).logits
    if reduction == "token":
        return token_cross_entropy(logits, batch["labels"]), {}
    loss_sum = token_cross_entropy_sum(logits, batch["labels"])
    return loss_sum, {}


# ---- per-token and per-sequence losses ------------------------------------------------------

# "sum": one 0-d tensor, the sum over label tokens; "token": a loss per position.
LOSS_REDUCTIONS = ("sum", "token")


def check_reduction(reduction: str) -> None:
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"reduction must be one of {LOSS_REDUCTIONS}, got {reduction!r}")


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy per position, float32 `[rows, width]` like labels: position t
    holds the loss of predicting labels[:, t + 1] (aligned with `shifted_labels`), 0 where
    that label is IGNORE_INDEX. Sums to `token_cross_entropy_sum` up to float32 rounding."""
    targets = shifted_labels(labels)
    losses = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return losses.reshape(targets.shape)


def sequence_sums(
    token_losses: torch.Tensor, sequence_ids: torch.Tensor, num_sequences: int
) -> torch.Tensor:
    """Per-sequence sums `[num_sequences]` of token losses: sequence_ids (shaped like the
    losses) gives each position's sample index in the micro-batch, -1 for positions of no
    sample. Differentiable, and free of host syncs (ids are not checked against
    num_sequences: an id out of range is an indexing error)."""
    if sequence_ids.shape != token_losses.shape:
        raise ValueError(
            f"sequence ids {tuple(sequence_ids.shape)} do not match "
            f"token losses {tuple(token_losses.shape)}"
        )
    ids = sequence_ids.reshape(-1).to(token_losses.device)
    # Positions of no sample go to one extra bin that is dropped: no boolean indexing.
    ids = torch.where(ids >= 0, ids, num_sequences)
    sums = token_losses.new_zeros(num_sequences + 1)
    return sums.index_add(0, ids, token_losses.reshape(-1))[:num_sequences]


def sequence_ids_from_batch(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each position's sample index within the micro-batch (LongTensor like labels), -1 on
    padding, numbered row by row in order of appearance.

    Packed rows (`position_ids`): a sample starts wherever the position ids restart at 0;
    padded rows: one sample per row. Positions that `token_mask` or `attention_mask` marks 0
    are padding, and a segment of padding only (the tail of a packed row) is no sample.
    The loss at position t is the prediction made by token t, so it counts for t's sample.
    """
    labels = batch["labels"]
    rows, width = labels.shape
    real = batch.get("token_mask", batch.get("attention_mask"))
    real = torch.ones_like(labels, dtype=torch.bool) if real is None else real.bool()
    real = real.to(labels.device)
    starts = torch.zeros((rows, width), dtype=torch.bool, device=labels.device)
    if "position_ids" in batch:
        starts |= batch["position_ids"].to(labels.device) == 0
    starts[:, 0] = True
    segments = starts.reshape(-1).cumsum(0) - 1
    # Number 0, 1, ... only the segments with a real token; index_add, not boolean
    # indexing, so that no step waits for the device.
    real_tokens = torch.zeros(rows * width, dtype=torch.long, device=labels.device)
    real_tokens.index_add_(0, segments, real.reshape(-1).long())
    numbers = (real_tokens > 0).cumsum(0) - 1
    return torch.where(real, numbers[segments].reshape(rows, width), -1)


def count_sequences(sequence_ids: torch.Tensor) -> int:
    """The number of samples that sequence_ids numbers (a host sync on an accelerator)."""
    return int(sequence_ids.max()) + 1 if sequence_ids.numel() else 0
