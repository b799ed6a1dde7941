"""`swiftlm rlhf --rlhf_type rm`: a reward model trained on preference pairs (Bradley-Terry).

The model is loaded as transformers' sequence classification with one output: the causal
LM's transformer and a new linear `score` head. The reward of a conversation is the head's
output at its last non-padding token (what transformers' `...ForSequenceClassification`
reads when the config names the pad token), so the whole conversation, prompt and answer, is
what gets scored; the answer's labels only decide whether a truncated pair is kept.

Rows are DPO's (data/preference.py: ms-swift `messages` + `rejected_response`/
`rejected_messages`, TRL `prompt`/`chosen`/`rejected`) plus an optional numeric `margin`
(TRL's RewardTrainer, Llama 2): the chosen reward should exceed the rejected one by about
that much. A micro-batch of B pairs is 2B rows, the chosen conversations first, as in DPO;
the loss -log sigma(r_c - r_r - margin) is summed over pairs and normalized by pairs
(losses/reward.py). With LoRA, peft's SEQ_CLS task trains the score head in full next to the
adapters and saves it with them, so a run's final/ is the reward model either way.

Logged per pair: loss, rewards/chosen, rewards/rejected, rewards/margins (r_c - r_r) and
rewards/accuracies (r_c > r_r).
"""

import math

import torch

from swiftlm.config import RLHFConfig
from swiftlm.data.columns import given
from swiftlm.data.rows import RowError, type_name
from swiftlm.errors import ConfigError
from swiftlm.losses.reward import bradley_terry_losses
from swiftlm.methods.base import Batch, Layout, LossOutput
from swiftlm.methods.preference.dpo import DPO, unwrapped, weighted_sums
from swiftlm.models.loader import SEQUENCE_CLASSIFICATION

PIPELINE_REFUSAL = (
    "--pipeline_parallel_size: swiftlm rlhf --rlhf_type rm has no pipeline-parallel form (its "
    "score head reads every row's last token); use data parallel, FSDP2 or DeepSpeed"
)


class RewardModel(DPO):
    """DPO's pairs, encoding and batches; a value head instead of log-probs, no reference."""

    name = "rm"
    model_kind = SEQUENCE_CLASSIFICATION
    columns = (*DPO.columns, "margin")
    supports_images = False  # a value head on a text transformer
    supports_packing = False  # the head reads each row's last token: one pair side per row

    def __init__(self, cfg: RLHFConfig, tokenizer):
        # Refused before the model loads: the pipeline stages are built from a causal LM.
        if cfg.dist.pipeline_parallel_size > 1 or cfg.dist.strategy == "pp":
            raise ConfigError(PIPELINE_REFUSAL)
        super().__init__(cfg, tokenizer)

    # -- data ----------------------------------------------------------------------------------

    def to_sample(self, record: dict) -> dict:
        sample = super().to_sample(record)
        return {**sample, "margin": read_margin(record.get("margin"))}

    def pair_sample(self, sample: dict, chosen: dict, rejected: dict) -> dict:
        """DPO's encoded pair plus the row's margin (0 without one)."""
        return {**super().pair_sample(sample, chosen, rejected), "margin": sample["margin"]}

    def collate(self, layout: Layout) -> Batch:
        """DPO's 2B rows (chosen first) and `weight` [B], plus `margin` [B]."""
        batch = super().collate(layout)
        batch["margin"] = torch.tensor([row[0]["margin"] for row in layout.rows])
        return batch

    # -- model and loss --------------------------------------------------------------------------

    def prepare_model(self, model: torch.nn.Module, log) -> None:
        policy = unwrapped(model)
        # The head reads each row's last token that is not the pad token: the ids must agree.
        policy.config.pad_token_id = self.tokenizer.pad_token_id
        # peft keeps adapters in float32 but its trained copy of the new score head in the
        # frozen base's dtype (bf16 with LoRA), where Adam's small updates would round away.
        for param in policy.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.float()
        log("rm: Bradley-Terry loss on a value head (score), no reference model")

    def loss(self, model: torch.nn.Module, batch: Batch) -> LossOutput:
        rewards = conversation_rewards(model, batch)
        pairs = rewards.shape[0] // 2
        chosen, rejected = rewards[:pairs], rewards[pairs:]
        margin = batch["margin"].to(rewards)
        losses = bradley_terry_losses(chosen, rejected, margin)
        return weighted_sums(losses, reward_metrics(chosen, rejected), batch)

    @staticmethod
    def pipeline_loss(logits: torch.Tensor, batch: Batch) -> LossOutput:
        raise ConfigError(PIPELINE_REFUSAL)


def conversation_rewards(model, batch: Batch) -> torch.Tensor:
    """The reward of each row, [rows] in float32: the score head at its last real token."""
    output = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    )
    return output.logits[:, 0].float()


def reward_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict:
    """TRL's reward-model metrics per pair (detached)."""
    chosen, rejected = chosen.detach(), rejected.detach()
    return {
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/margins": chosen - rejected,
        "rewards/accuracies": (chosen > rejected).float(),
    }


def read_margin(value) -> float:
    """The row's `margin` column as a float (0 when absent); a RowError when it is not a
    finite number. Numeric strings pass: CSV files hold every value as text."""
    if not given(value):  # parquet and hub datasets fill an absent column with None
        return 0.0
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise RowError(
            "bad field type",
            f"`margin` must be a number (how far the chosen reward should exceed the rejected "
            f"one), got {type_name(value)} {value!r}",
        )
    if not math.isfinite(number):
        raise RowError("bad field type", f"`margin` must be a finite number, got {value!r}")
    return float(number)
