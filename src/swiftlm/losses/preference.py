"""Preference-optimization losses as pure functions of per-sequence log-probs.

Every function takes float tensors `[B]` (one value per pair or per sample) and returns the
loss of each pair or sample, `[B]`, not reduced: the method sums them (see methods/base.py).
The formulas follow TRL's trainers (DPOTrainer.dpo_loss, CPOTrainer.cpo_loss,
ORPOTrainer.odds_ratio_loss, KTOTrainer.kto_loss); the NLL/SFT terms that CPO and ORPO add
on the chosen responses are computed elsewhere. Notation: sigma is the logistic sigmoid,
log sigma(x) = -softplus(-x), c / r the chosen / rejected log-probs, c0 / r0 the reference's.
"""

import math

import torch
import torch.nn.functional as F

# The loss types `--loss_type` offers, defined once with the flag.
from swiftlm.losses.loss_types import CPO_LOSS_TYPES, DPO_LOSS_TYPES, KTO_LOSS_TYPES

# exo_pair takes log(eps) of the label smoothing; TRL uses 1e-3 when it is 0.
_EXO_DEFAULT_EPSILON = 1e-3
_MINUS_LN2 = -0.6931471805599453


def _smoothed_sigmoid(x: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-(1 - ls) log sigma(x) - ls log sigma(-x): the logistic loss with flipped-label mass ls."""
    return -F.logsigmoid(x) * (1 - label_smoothing) - F.logsigmoid(-x) * label_smoothing


def dpo_rewards(logps: torch.Tensor, ref_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """Implicit DPO reward beta * (logps - ref_logps), detached (for logging)."""
    return (beta * (logps - ref_logps)).detach()


def dpo_losses(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
    bco_shift: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """Per-pair loss of DPO and its variants (TRL DPOTrainer.dpo_loss, reverse-KL form).

    With u_c = c - c0, u_r = r - r0 (log-ratios), h = u_c - u_r, z = beta h, ls = label_smoothing:

    - sigmoid (DPO, arXiv 2305.18290; cDPO when ls > 0): -(1-ls) log sigma(z) - ls log sigma(-z)
    - hinge (SLiC, 2305.10425): max(0, 1 - z)
    - ipo (IPO, 2310.12036, eq. 17): (h - 1/(2 beta))^2; TRL feeds IPO length-averaged
      log-probs, so pass averages here for the paper's form
    - robust (rDPO, 2403.00409): (-(1-ls) log sigma(z) + ls log sigma(-z)) / (1 - 2 ls)
    - exo_pair (EXO, 2402.00856, eq. 16), eps = ls or 1e-3 when ls = 0:
      sigma(z) (log sigma(z) - log(1-eps)) + sigma(-z) (log sigma(-z) - log eps)
    - nca_pair (NCA, 2402.05369): -log sigma(beta u_c) - log sigma(-beta u_c)/2
      - log sigma(-beta u_r)/2
    - sppo_hard (SPPO, 2405.00675, hard labels): (u_c - 1/(2 beta))^2 + (u_r + 1/(2 beta))^2
    - aot (AOT, 2406.05882, paired): d = sort(c - r) - sort(c0 - r0) over the batch,
      then the smoothed sigmoid loss of beta d
    - aot_pair (AOT, TRL's old name of "aot_unpaired"): d = sort(u_c) - sort(u_r), same loss
    - apo_zero (APO, 2408.06266, eq. 7): 1 - sigma(beta u_c) + sigma(beta u_r)
    - apo_down (APO, eq. 8): sigma(beta u_c) + 1 - sigma(z)
    - discopop (DiscoPOP / LRML, 2406.08414, eq. 5), m = sigma(z / tau):
      -(1 - m) log sigma(z) + m exp(-z)
    - bco_pair (BCO, 2404.04656, paired form of TRL <= 0.21), delta = `bco_shift` (the running
      mean of the rewards, see RunningMean): -log sigma(beta u_c - delta)
      - log sigma(-(beta u_r - delta))

    The aot losses sort over the batch, so their i-th loss is not tied to the i-th pair.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; expected one of {DPO_LOSS_TYPES}")
    ls = label_smoothing
    chosen_ratios = chosen_logps - ref_chosen_logps
    rejected_ratios = rejected_logps - ref_rejected_logps
    h = (chosen_logps - rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    z = beta * h

    if loss_type == "sigmoid":
        return _smoothed_sigmoid(z, ls)
    if loss_type == "hinge":
        return torch.relu(1 - z)
    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    if loss_type == "robust":
        return (-(1 - ls) * F.logsigmoid(z) + ls * F.logsigmoid(-z)) / (1 - 2 * ls)
    if loss_type == "exo_pair":
        eps = ls if ls != 0 else _EXO_DEFAULT_EPSILON
        chosen_term = torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
        return chosen_term + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps))
    if loss_type == "nca_pair":
        chosen_rewards, rejected_rewards = beta * chosen_ratios, beta * rejected_ratios
        return (
            -F.logsigmoid(chosen_rewards)
            - 0.5 * F.logsigmoid(-chosen_rewards)
            - 0.5 * F.logsigmoid(-rejected_rewards)
        )
    if loss_type == "sppo_hard":
        return (chosen_ratios - 0.5 / beta) ** 2 + (rejected_ratios + 0.5 / beta) ** 2
    if loss_type == "aot":
        logratios, _ = torch.sort(chosen_logps - rejected_logps, dim=0)
        ref_logratios, _ = torch.sort(ref_chosen_logps - ref_rejected_logps, dim=0)
        return _smoothed_sigmoid(beta * (logratios - ref_logratios), ls)
    if loss_type == "aot_pair":
        chosen_sorted, _ = torch.sort(chosen_ratios, dim=0)
        rejected_sorted, _ = torch.sort(rejected_ratios, dim=0)
        return _smoothed_sigmoid(beta * (chosen_sorted - rejected_sorted), ls)
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen_ratios) + torch.sigmoid(beta * rejected_ratios)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * chosen_ratios) + 1 - torch.sigmoid(z)
    if loss_type == "bco_pair":
        shift = torch.as_tensor(bco_shift, dtype=chosen_ratios.dtype, device=chosen_ratios.device)
        return -F.logsigmoid(beta * chosen_ratios - shift) - F.logsigmoid(
            -(beta * rejected_ratios - shift)
        )
    # discopop
    modulation = torch.sigmoid(z / discopop_tau)
    return -F.logsigmoid(z) * (1 - modulation) + torch.exp(-z) * modulation


def bco_batch_reward(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mean implicit reward of a micro-batch, over its chosen AND rejected answers (TRL's
    `torch.cat((chosen_rewards, rejected_rewards)).mean()`), detached; `weight` [B] leaves out
    padding pairs (weight 0)."""
    rewards = beta * torch.cat(
        [chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps]
    )
    if weight is None:
        return rewards.mean().detach()
    w = torch.cat([weight, weight]).to(rewards)
    return ((rewards * w).sum() / w.sum().clamp(min=1e-12)).detach()


class RunningMean:
    """The running mean of a stream of micro-batch means, each counted once (TRL's
    RunningMoments as bco_pair used it: `update(batch_mean)` with a count of 1).

    mean_k = mean_{k-1} + (x_k - mean_{k-1}) / k, i.e. the plain average of the k values
    seen. TRL starts its count at 1e-24, which gives the same first value."""

    def __init__(self, mean: float = 0.0, count: int = 0):
        self.mean, self.count = mean, count

    def update(self, value: float) -> float:
        """Fold in one micro-batch's mean; return the new running mean."""
        self.count += 1
        self.mean += (float(value) - self.mean) / self.count
        return self.mean


def weighted_dpo_losses(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    loss_types: list[str],
    loss_weights: list[float] | None = None,
    **options,
) -> torch.Tensor:
    """sum_k w_k loss_k per pair (TRL's `loss_type` list with `loss_weights`, default 1 each).
    TRL adds w_k mean(loss_k); the mean of the sum is the same number."""
    weights = loss_weights if loss_weights is not None else [1.0] * len(loss_types)
    total = None
    for loss_type, weight in zip(loss_types, weights, strict=True):
        losses = weight * dpo_losses(
            chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
            loss_type=loss_type, **options,
        )  # fmt: skip
        total = losses if total is None else total + losses
    return total


def simpo_losses(
    chosen_avg_logps: torch.Tensor,
    rejected_avg_logps: torch.Tensor,
    *,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """SimPO (arXiv 2405.14734; TRL CPOTrainer loss_type "simpo"), on length-averaged log-probs.

    h = (c - r) - gamma / beta;  loss = -(1-ls) log sigma(beta h) - ls log sigma(-beta h).
    """
    logits = (chosen_avg_logps - rejected_avg_logps) - gamma / beta
    return _smoothed_sigmoid(beta * logits, label_smoothing)


def cpo_losses(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """CPO's reference-free preference term (arXiv 2401.08417; TRL CPOTrainer.cpo_loss).

    h = c - r:
    - sigmoid (eq. 3): -(1-ls) log sigma(beta h) - ls log sigma(-beta h)
    - hinge: max(0, 1 - beta h)
    - ipo: (h - 1/(2 beta))^2
    The NLL term on the chosen responses is added by the caller.
    """
    if loss_type not in CPO_LOSS_TYPES:
        raise ValueError(f"unknown CPO loss_type {loss_type!r}; expected one of {CPO_LOSS_TYPES}")
    logits = chosen_logps - rejected_logps
    if loss_type == "sigmoid":
        return _smoothed_sigmoid(beta * logits, label_smoothing)
    if loss_type == "hinge":
        return torch.relu(1 - beta * logits)
    return (logits - 1 / (2 * beta)) ** 2


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0: log1p(-exp(x)) below -ln 2, log(-expm1(x)) above (Maechler).
    Each branch sees only inputs in its own range, so neither puts a NaN in the gradient."""
    low = torch.log1p(-torch.exp(torch.clamp(x, max=_MINUS_LN2)))
    high = torch.log(-torch.expm1(torch.clamp(x, min=_MINUS_LN2)))
    return torch.where(x < _MINUS_LN2, low, high)


def orpo_losses(
    chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor, *, beta: float
) -> torch.Tensor:
    """ORPO's odds-ratio term (arXiv 2403.07691, eqs. 4 and 7; TRL ORPOTrainer.odds_ratio_loss).

    log odds(p) = c - log(1 - exp(c)) on average log-probs, so
    log_odds = (c - r) - (log(1 - exp(c)) - log(1 - exp(r)));  loss = -beta log sigma(log_odds).
    The NLL term on the chosen responses is added by the caller.
    """
    log_odds = (chosen_avg_logps - rejected_avg_logps) - (
        _log1mexp(chosen_avg_logps) - _log1mexp(rejected_avg_logps)
    )
    return -beta * F.logsigmoid(log_odds)


def kto_losses(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    kl: torch.Tensor,
    desirable: torch.Tensor,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> torch.Tensor:
    """KTO and its unpaired APO variant (TRL KTOTrainer), one loss per sample.

    u = policy - ref; kl the batch's reference-point KL estimate (a scalar the caller detached
    and clamped at 0; unused by apo_zero_unpaired):
    - kto (arXiv 2402.01306, eq. 7):
      desirable w_d (1 - sigma(beta (u - kl))), undesirable w_u (1 - sigma(beta (kl - u)))
    - apo_zero_unpaired (APO, 2408.06266, eq. 7 unpaired):
      desirable w_d (1 - sigma(beta u)), undesirable w_u sigma(beta u)
    Losses stay in sample order (TRL concatenates the desirable ones first).
    """
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}; expected one of {KTO_LOSS_TYPES}")
    logratios = policy_logps - ref_logps
    if loss_type == "apo_zero_unpaired":
        desirable_losses = 1 - torch.sigmoid(beta * logratios)
        undesirable_losses = torch.sigmoid(beta * logratios)
    else:
        desirable_losses = 1 - torch.sigmoid(beta * (logratios - kl))
        undesirable_losses = 1 - torch.sigmoid(beta * (kl - logratios))
    return torch.where(
        desirable, desirable_weight * desirable_losses, undesirable_weight * undesirable_losses
    )
