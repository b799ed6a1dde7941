"""`swiftlm rlhf --rlhf_type dpo`: Direct Preference Optimization and its loss variants.

Rows are preference pairs (data/preference.py). A micro-batch holds B pairs as 2B rows, the
chosen conversations first, and one forward pass of the policy gives the log-prob of each
answer (summed over its label tokens, the last assistant turn). The reference's log-probs
come from the same weights with the LoRA adapter switched off (no second copy of the model)
or, with full fine-tuning, from a frozen copy taken before training. The loss of each pair is
a pure function of the four log-probs (losses/preference.py); the loop normalizes by the
number of pairs in the optimizer step, so gradient accumulation is exact.

Logged per pair: loss, rewards/chosen = beta (c - c0), rewards/rejected, rewards/margins,
rewards/accuracies (chosen reward above rejected), logps/chosen, logps/rejected, and nll
(mean token NLL of the chosen answers), which --rpo_alpha adds to the loss.
"""

import contextlib
import copy

import torch

from swiftlm.config import RLHFConfig
from swiftlm.data.collate import collate
from swiftlm.data.encode import IGNORE_INDEX, TruncationReport, encode_chat, truncate
from swiftlm.data.preference import preference_sample
from swiftlm.errors import DataError
from swiftlm.losses.causal_lm import shifted_labels, token_cross_entropy
from swiftlm.losses.preference import dpo_losses, dpo_rewards
from swiftlm.methods.base import Batch, EncodeResult, Layout, LossOutput
from swiftlm.methods.token import token_pads

SIDES = ("chosen", "rejected")


class DPO:
    name = "dpo"
    columns = (
        "chosen_input_ids",
        "chosen_labels",
        "rejected_input_ids",
        "rejected_labels",
        "weight",
    )
    supports_packing = False
    default_datasets: tuple[str, ...] = ()

    def __init__(self, cfg: RLHFConfig, tokenizer):
        self.tokenizer = tokenizer
        self.token_pads = token_pads(tokenizer.pad_token_id)
        self.data, self.rlhf = cfg.data, cfg.rlhf
        self.uses_lora = cfg.tuner.train_type != "full"
        self.reference = None  # a frozen copy, with full fine-tuning only

    # -- data ----------------------------------------------------------------------------------

    def to_sample(self, record: dict) -> dict:
        return preference_sample(record, method="swiftlm rlhf", system=self.data.system)

    def encode(self, samples: list[dict]) -> EncodeResult:
        """Each side's ids and labels (loss on its last answer); over-long pairs follow
        --truncation_strategy, and a pair with a side left without label tokens is dropped."""
        d = self.data
        report = TruncationReport(d.truncation_strategy, d.max_length)
        encoded = []
        for sample in samples:
            sides = [
                truncate(
                    encode_chat(self.tokenizer, sample[side], "last_turn"),
                    d.max_length,
                    d.truncation_strategy,
                    report,
                )
                for side in SIDES
            ]
            if None not in sides:
                encoded.append(_pair(*sides))
        if not encoded:
            raise DataError(
                f"no preference pair fits --max_length {d.max_length} with "
                f"--truncation_strategy {d.truncation_strategy} ({report}); raise --max_length"
            )
        return EncodeResult(encoded, [report.summary()] if report.summary() else [])

    def cache_options(self) -> dict:
        d = self.data
        return {
            "method": self.name,
            "max_length": d.max_length,
            "truncation_strategy": d.truncation_strategy,
            "system": d.system,
        }

    @staticmethod
    def length(sample: dict) -> int:
        return len(sample["chosen_input_ids"]) + len(sample["rejected_input_ids"])

    @staticmethod
    def masked(sample: dict) -> dict:
        return {**sample, "weight": 0.0}

    def collate(self, layout: Layout) -> Batch:
        """2B right-padded rows, the B chosen answers first; `weight` [B] (0 for padding)."""
        pairs = [row[0] for row in layout.rows]
        rows = [
            {"input_ids": p[f"{side}_input_ids"], "labels": p[f"{side}_labels"]}
            for side in SIDES
            for p in pairs
        ]
        batch = collate(rows, self.tokenizer.pad_token_id)
        batch["weight"] = torch.tensor([p["weight"] for p in pairs], dtype=torch.float32)
        return batch

    @staticmethod
    def normalizer(batch: Batch) -> float:
        """Pairs (padding pairs of an idle data-parallel rank weigh 0)."""
        return float(batch["weight"].sum())

    # -- model and loss --------------------------------------------------------------------------

    def prepare_model(self, model: torch.nn.Module, log) -> None:
        r = self.rlhf
        log(
            f"dpo: beta {r.beta}, loss_type {r.loss_type}, label_smoothing {r.label_smoothing}, "
            f"rpo_alpha {r.rpo_alpha}"
        )
        if self.uses_lora:
            log("dpo: reference = the base model with the adapter disabled (no second copy)")
            return
        self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        log("dpo: reference = a frozen copy of the initial model (full fine-tuning)")

    def loss(self, model: torch.nn.Module, batch: Batch) -> LossOutput:
        logps, counts = answer_logps(model, batch)
        reference, context = self._reference(model)
        with torch.no_grad():
            ref_logps, _ = answer_logps(reference, batch, context)
        pairs = logps.shape[0] // 2
        chosen, rejected = logps[:pairs], logps[pairs:]
        ref_chosen, ref_rejected = ref_logps[:pairs], ref_logps[pairs:]
        r = self.rlhf
        losses = dpo_losses(
            chosen, rejected, ref_chosen, ref_rejected,
            beta=r.beta, loss_type=r.loss_type, label_smoothing=r.label_smoothing,
        )  # fmt: skip
        nll = -chosen / counts[:pairs]
        if r.rpo_alpha:
            losses = losses + r.rpo_alpha * nll
        rewards = (
            dpo_rewards(chosen, ref_chosen, r.beta),
            dpo_rewards(rejected, ref_rejected, r.beta),
        )
        return weighted_sums(losses, pair_metrics(chosen, rejected, *rewards, nll), batch)

    def _reference(self, model):
        """(the module to run, its context): the frozen copy, or the policy without adapter."""
        if self.reference is not None:
            return self.reference, contextlib.nullcontext()
        policy = unwrapped(model)
        return policy, policy.disable_adapter()

    @staticmethod
    def pipeline_loss(logits: torch.Tensor, batch: Batch) -> LossOutput:
        from swiftlm.errors import ConfigError

        raise ConfigError(
            "--pipeline_parallel_size: swiftlm rlhf (DPO) has no pipeline-parallel form; use "
            "data parallel, FSDP2 or DeepSpeed"
        )


def answer_logps(model, batch: Batch, context=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the sum of the label tokens' log-probs (float32) and their number."""
    with context or contextlib.nullcontext():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        ).logits
    token_logps = -token_cross_entropy(logits, batch["labels"])
    counts = (shifted_labels(batch["labels"]) != IGNORE_INDEX).sum(-1).to(token_logps)
    return token_logps.sum(-1), counts.clamp(min=1)


def pair_metrics(chosen, rejected, rewards_chosen, rewards_rejected, nll) -> dict:
    """What every preference method logs per pair (TRL's names)."""
    return {
        "rewards/chosen": rewards_chosen,
        "rewards/rejected": rewards_rejected,
        "rewards/margins": rewards_chosen - rewards_rejected,
        "rewards/accuracies": (rewards_chosen > rewards_rejected).float(),
        "logps/chosen": chosen.detach(),
        "logps/rejected": rejected.detach(),
        "nll": nll.detach(),
    }


def weighted_sums(losses: torch.Tensor, metrics: dict, batch: Batch) -> LossOutput:
    """(loss SUM, metric SUMS) over the pairs, padding pairs (weight 0) left out."""
    weight = batch["weight"].to(losses.device)
    return (losses * weight).sum(), {k: (v * weight).sum() for k, v in metrics.items()}


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP / DeepSpeed wrappers (they hold it as `.module`)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _pair(chosen: dict, rejected: dict) -> dict:
    return {
        "chosen_input_ids": chosen["input_ids"],
        "chosen_labels": chosen["labels"],
        "rejected_input_ids": rejected["input_ids"],
        "rejected_labels": rejected["labels"],
        "weight": 1.0,
    }
