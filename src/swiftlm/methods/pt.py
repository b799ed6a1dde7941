"""`swiftlm pt`: continued pre-training on plain text, with loss on every token.

Documents are joined with the EOS token and cut into --max_length chunks; the loss is the
mean next-token cross-entropy over all of them. A last chunk of one token has nothing to
predict: it is dropped, and the log says so.
"""

from swiftlm.config import TrainConfig
from swiftlm.data.encode import encode_pretraining
from swiftlm.data.formats import text_sample
from swiftlm.methods.base import EncodeResult
from swiftlm.methods.token import NextTokenObjective


class PT(NextTokenObjective):
    name = "pt"
    default_datasets = ()  # --dataset is required

    def __init__(self, cfg: TrainConfig, tokenizer):
        super().__init__(tokenizer, cfg.train.fused_cross_entropy)
        self.max_length = cfg.data.max_length

    def to_sample(self, record: dict) -> dict:
        return text_sample(record)

    def encode(self, samples: list[dict]) -> EncodeResult:
        texts = [s["text"] for s in samples]
        chunks, dropped = encode_pretraining(self.tokenizer, texts, self.max_length)
        # Only the last chunk can be one token long: dropped <= 1.
        note = "pt: dropped the last chunk, a single token (nothing to predict)"
        # Documents are cut into chunks, never truncated: only a one-token chunk can be dropped.
        counts = {"max_length": self.max_length, "strategy": "chunks", "dropped": dropped}
        return EncodeResult(chunks, [note] if dropped else [], counts)

    def cache_options(self) -> dict:
        return {"method": self.name, "max_length": self.max_length}
