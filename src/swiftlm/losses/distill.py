"""The generalized Jensen-Shannon divergence of on-policy distillation (GKD, Agarwal et al.
2024, Eq. 1), per token, with TRL's `GKDTrainer.generalized_jsd_loss` convention.

With P_T = softmax(teacher_logits / temperature), P_S = softmax(student_logits / temperature),
both over the vocabulary at one position, and KL(P || Q) = sum_v P(v) (log P(v) - log Q(v)):

    beta = 0:      KL(P_T || P_S)                             forward KL (mode covering)
    beta = 1:      KL(P_S || P_T)                             reverse KL (mode seeking)
    0 < beta < 1:  beta KL(P_T || M) + (1 - beta) KL(P_S || M),
                   M = beta P_T + (1 - beta) P_S              the generalized JSD

log M is computed in log space, logsumexp(log P_T + log beta, log P_S + log(1 - beta)), so no
probability underflows. Note that, as in TRL, the end points are special cases: the
mixture form itself tends to 0 as beta -> 0 or 1 (M -> P_S or P_T); beta 0 and 1 are the
plain KLs instead. beta 0.5 is the ordinary JSD.

`top_k`: both distributions are restricted to the teacher's k most likely tokens at that
position and renormalized there (log_softmax of the k gathered logits / temperature), then
compared with the same formula. Tokens outside the teacher's top k carry no loss: a student
mass on them is not penalized. It saves the [rows, width, vocab] intermediates of the
mixture on large vocabularies.
"""

import math

import torch
import torch.nn.functional as F


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> torch.Tensor:
    """Per-position losses [B, T] (0 where `mask` is 0) from logits [B, T, V]; sum them.

    The logits at position t predict token t + 1: `mask` marks the positions whose next
    token is a completion token (losses.causal_lm.shifted_labels != IGNORE_INDEX).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta {beta}: the generalized JSD needs 0 <= beta <= 1")
    student = student_logits.float() / temperature
    teacher = teacher_logits.float() / temperature
    if top_k is not None and top_k < teacher.shape[-1]:
        chosen = teacher.topk(top_k, dim=-1).indices
        student, teacher = student.gather(-1, chosen), teacher.gather(-1, chosen)
    log_s = F.log_softmax(student, dim=-1)
    log_t = F.log_softmax(teacher, dim=-1)
    per_token = _divergence(log_s, log_t, beta).sum(-1)
    return per_token * mask.to(per_token.dtype)


def _divergence(log_s: torch.Tensor, log_t: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-vocabulary-entry terms of the module docstring's formula (sum them over the last
    dimension)."""
    if beta == 0.0:
        return _kl_terms(log_t, log_s)
    if beta == 1.0:
        return _kl_terms(log_s, log_t)
    log_m = torch.logsumexp(torch.stack([log_t + math.log(beta), log_s + math.log1p(-beta)]), dim=0)
    return beta * _kl_terms(log_t, log_m) + (1.0 - beta) * _kl_terms(log_s, log_m)


def _kl_terms(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """P(v) (log P(v) - log Q(v)) per entry: the terms of KL(P || Q) (0 where P(v) = 0)."""
    return F.kl_div(log_q, log_p, reduction="none", log_target=True)
