"""`swiftlm sft`: supervised fine-tuning on conversations, with loss on the assistant turns.

Rows are conversations in any format `data.formats` reads (messages, sharegpt, alpaca, ...),
tool-calling rows included (rendered with the chat template's tools, the calls trained); the
loss is the mean next-token cross-entropy over the label tokens chosen by --loss_scope.
"""

from swiftlm.config import TrainConfig
from swiftlm.data.columns import refuse_media_parts
from swiftlm.data.encode import encode_chat_samples
from swiftlm.data.formats import chat_sample
from swiftlm.methods.base import EncodeResult
from swiftlm.methods.token import NextTokenObjective


class SFT(NextTokenObjective):
    name = "sft"
    # `swiftlm sft` with neither --model nor --dataset: teach the packaged SmolLM2 a new name,
    # mixed with ordinary Q&A so it keeps answering other questions.
    default_datasets = ("swiftlm/self-cognition", "swiftlm/general-qa")

    def __init__(self, cfg: TrainConfig, tokenizer):
        super().__init__(tokenizer, cfg.train.fused_cross_entropy)
        self.data = cfg.data
        self.placeholders = {"{{NAME}}": cfg.model.model_name, "{{AUTHOR}}": cfg.model.model_author}

    def to_sample(self, record: dict) -> dict:
        """A conversation, with its tools if the row has some; images and columns for other
        methods are refused (see formats.chat_sample)."""
        sample = chat_sample(record, system=self.data.system, placeholders=self.placeholders)
        refuse_media_parts(sample["messages"], self.name)
        return sample

    def encode(self, samples: list[dict]) -> EncodeResult:
        d = self.data
        encoded, truncation = encode_chat_samples(
            self.tokenizer, samples, d.max_length, d.truncation_strategy, d.loss_scope
        )
        log = [truncation.summary()] if truncation.summary() else []
        return EncodeResult(encoded, log, truncation.as_dict())

    def cache_options(self) -> dict:
        d = self.data
        return {
            "method": self.name,
            "max_length": d.max_length,
            "truncation_strategy": d.truncation_strategy,
            "loss_scope": d.loss_scope,
            "system": d.system,
            "placeholders": list(self.placeholders.values()),
        }
