"""`swiftlm rlhf --rlhf_type simpo|orpo|cpo`: preference methods without a reference model.

They read, encode and batch pairs exactly as DPO does (methods/preference/dpo.py) and differ only in the
loss, a pure function of the policy's answer log-probs (losses/preference.py), plus a
negative log-likelihood term on the chosen answers (token mean per pair):

- simpo (SimPO): length-averaged log-probs, -log sigma(beta (c - r) - gamma) (label-smoothed),
  plus --cpo_alpha x NLL (ms-swift's default 1; 0 gives the paper's pure SimPO);
- orpo (ORPO): NLL - beta log sigma(log odds ratio) on length-averaged log-probs;
- cpo (CPO): --loss_type sigmoid|hinge|ipo on summed log-probs (averaged for ipo, as TRL),
  plus --cpo_alpha x NLL.

Logged like DPO, with rewards = beta x the log-probs the loss compares.
"""

import torch

from swiftlm.losses.preference import cpo_losses, orpo_losses, simpo_losses
from swiftlm.methods.base import Batch, LossOutput
from swiftlm.methods.preference.dpo import DPO, answer_logps, pair_metrics, weighted_sums


class ReferenceFree(DPO):
    """The shared part: no reference model; `pair_losses` is the method's."""

    def prepare_model(self, model: torch.nn.Module, log) -> None:
        log(f"{self.name}: {self.settings()}; no reference model")

    def settings(self) -> str:
        r = self.rlhf
        return f"beta {r.beta}, cpo_alpha {r.cpo_alpha}"

    def loss(self, model: torch.nn.Module, batch: Batch) -> LossOutput:
        logps, counts = answer_logps(model, batch)
        pairs = logps.shape[0] // 2
        averages = logps / counts
        nll = -averages[:pairs]
        losses, compared = self.pair_losses(logps, averages, pairs)
        losses = losses + self.nll_weight() * nll
        beta = self.rlhf.beta
        rewards = (beta * compared[:pairs]).detach(), (beta * compared[pairs:]).detach()
        metrics = pair_metrics(logps[:pairs], logps[pairs:], *rewards, nll)
        return weighted_sums(losses, metrics, batch)

    def nll_weight(self) -> float:
        return self.rlhf.cpo_alpha

    def pair_losses(self, sums, averages, pairs) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-pair losses, the log-probs they compare: sums or averages)."""
        raise NotImplementedError


class SimPO(ReferenceFree):
    name = "simpo"

    def settings(self) -> str:
        r = self.rlhf
        return f"{super().settings()}, simpo_gamma {r.simpo_gamma}, label_smoothing {r.label_smoothing}"

    def pair_losses(self, sums, averages, pairs):
        r = self.rlhf
        losses = simpo_losses(
            averages[:pairs], averages[pairs:],
            beta=r.beta, gamma=r.simpo_gamma, label_smoothing=r.label_smoothing,
        )  # fmt: skip
        return losses, averages


class ORPO(ReferenceFree):
    name = "orpo"

    def settings(self) -> str:
        return f"beta {self.rlhf.beta}"

    def nll_weight(self) -> float:
        return 1.0  # ORPO's loss is the NLL plus the odds-ratio term

    def pair_losses(self, sums, averages, pairs):
        return orpo_losses(averages[:pairs], averages[pairs:], beta=self.rlhf.beta), averages


class CPO(ReferenceFree):
    name = "cpo"

    def settings(self) -> str:
        r = self.rlhf
        return f"{super().settings()}, loss_type {r.loss_type}, label_smoothing {r.label_smoothing}"

    def pair_losses(self, sums, averages, pairs):
        r = self.rlhf
        compared = averages if r.loss_type == "ipo" else sums  # as TRL's CPOTrainer
        losses = cpo_losses(
            compared[:pairs], compared[pairs:],
            beta=r.beta, loss_type=r.loss_type, label_smoothing=r.label_smoothing,
        )  # fmt: skip
        return losses, compared
