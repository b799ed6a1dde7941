"""The reward-model loss (Bradley-Terry) as a pure function of the two rewards of each pair.

A reward model maps a conversation to one number, its reward r. Bradley-Terry models the
probability that the chosen answer is preferred as sigma(r_c - r_r); training maximizes its
log-likelihood, and a per-pair `margin` m (TRL's RewardTrainer, Llama 2's reward models) asks
the chosen reward to exceed the rejected one by at least about m:

    loss = -log sigma(r_c - r_r - m) = softplus(-(r_c - r_r - m))

with sigma the logistic sigmoid. softplus keeps it finite for any reward gap (a naive
log(sigmoid(x)) underflows to -inf for x below about -100 in float32).
"""

import torch
import torch.nn.functional as F


def bradley_terry_losses(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float = 0.0
) -> torch.Tensor:
    """Per-pair loss -log sigma(r_c - r_r - m), `[B]`, not reduced (the method sums it).

    `chosen`, `rejected`: the rewards `[B]`; `margin`: `[B]` or a number (0: no margin)."""
    return F.softplus(-(chosen - rejected - margin))
