"""GRPO's loss and advantages as pure functions of per-token log-probs and rewards.

Notation, per completion i of a micro-batch and completion token t (mask m_it):
- logp_it: the policy's log-prob of the sampled token (logits divided by the temperature),
  old_it: the same under the policy that sampled it (equal to logp, detached, when each
  generation trains one optimizer step), ref_it: under the reference model.
- The importance ratio rho_it = exp(logp_it - old_it) per token (GRPO), or
  rho_i = exp(sum_t m_it (logp_it - old_it) / sum_t m_it) per sequence (GSPO).
- The clipped surrogate l_it = -min(rho A_i, clip(rho, 1 - eps_low, 1 + eps_high) A_i).
- The KL to the reference (Schulman's k3, unbiased and positive):
  k_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1, added as beta k_it.

How the token losses become one number (`--loss_type`), with L = --max_completion_length:
- grpo: the mean over sequences of each sequence's token mean (the paper's; long and short
  completions weigh the same per sequence);
- bnpo, dapo: the mean over every completion token of the step (DAPO's token-level loss);
  TRL's bnpo averages per micro-batch and its dapo per step, here both are per step, so
  they are the same and exact under gradient accumulation;
- dr_grpo: the token sum divided by (sequences x L) (Dr. GRPO: no length bias).
`reduce_tokens` returns the SUM over the micro-batch and `normalizer` the units it is over;
the loop divides by the normalizer summed over the step's micro-batches and ranks.
"""

import torch

from swiftlm.losses.loss_types import GRPO_LOSS_TYPES  # what --loss_type offers

STD_EPSILON = 1e-4  # TRL's: keeps a group with near-equal rewards from exploding


def group_advantages(
    rewards: torch.Tensor, *, estimator: str = "grpo", scale: str = "group", batch_std=None
) -> torch.Tensor:
    """Advantages of `rewards` [groups, G] (each row one prompt's G completions).

    grpo: r - mean(group); rloo: r - mean(the other G-1 of the group) = G/(G-1) (r - mean).
    scale group: divided by the group's std (unbiased, as torch.std) + 1e-4; batch: by
    `batch_std` (the std over the whole step, every rank: the caller computes it) + 1e-4;
    none: not divided (Dr. GRPO)."""
    size = rewards.shape[1]
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if estimator == "rloo":
        centered = centered * size / (size - 1)
    if scale == "group":
        return centered / (rewards.std(dim=1, keepdim=True) + STD_EPSILON)
    if scale == "batch":
        return centered / (float(batch_std) + STD_EPSILON)
    return centered


def clipped_surrogate(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token losses l_it [B, T], per-token clipped flags [B, T]) of the module docstring."""
    log_ratio = logps - old_logps
    if level == "sequence":
        per_sequence = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_ratio = per_sequence.unsqueeze(-1).expand_as(logps)
    ratio = torch.exp(log_ratio)
    advantages = advantages.unsqueeze(-1)
    clipped_ratio = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    losses = -torch.min(ratio * advantages, clipped_ratio * advantages)
    clipped = ((ratio < 1 - epsilon_low) & (advantages < 0)) | (
        (ratio > 1 + epsilon_high) & (advantages > 0)
    )
    return losses, clipped.to(logps.dtype)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(d) - d - 1, d = ref - logp."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def reduce_tokens(values: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The micro-batch SUM of per-token `values` [B, T] the way `loss_type` weighs them: per
    sequence token means (grpo), or plain token sums (bnpo, dapo, dr_grpo)."""
    masked = values * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    if loss_type in ("bnpo", "dapo", "dr_grpo"):
        return masked.sum()
    raise ValueError(f"unknown GRPO loss_type {loss_type!r}; expected one of {GRPO_LOSS_TYPES}")


def normalizer(
    mask: torch.Tensor, weight: torch.Tensor, loss_type: str, max_length: int
) -> torch.Tensor:
    """The units `reduce_tokens` sums over: sequences (grpo), completion tokens (bnpo, dapo),
    sequences x max_completion_length (dr_grpo). Rows of weight 0 (padding) count for none."""
    real = weight > 0
    if loss_type == "grpo":
        return real.sum().double()
    if loss_type == "dr_grpo":
        return real.sum().double() * max_length
    return mask[real].sum().double()
