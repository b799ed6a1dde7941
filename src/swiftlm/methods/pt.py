"""`swiftlm pt`: continued pre-training on plain text, with loss on every token.

Documents are joined with the EOS token and cut into --max_length chunks; the loss is the
mean next-token cross-entropy over all of them.
"""

from swiftlm.config import TrainConfig
from swiftlm.data.encode import encode_pretraining
from swiftlm.data.formats import text_sample
from swiftlm.methods import token
from swiftlm.methods.base import Batch, EncodeResult, Layout, LossOutput


class PT:
    name = "pt"
    columns = ("input_ids", "labels")
    supports_packing = True
    default_datasets = ()  # --dataset is required

    def __init__(self, cfg: TrainConfig, tokenizer):
        self.max_length, self.tokenizer = cfg.data.max_length, tokenizer
        self.token_pads = token.token_pads(tokenizer.pad_token_id)
        self.loss_fn = token.TokenLoss(cfg.train.fused_cross_entropy)

    def to_sample(self, record: dict) -> dict:
        return text_sample(record)

    def encode(self, samples: list[dict]) -> EncodeResult:
        texts = [s["text"] for s in samples]
        return EncodeResult(encode_pretraining(self.tokenizer, texts, self.max_length))

    def cache_options(self) -> dict:
        return {"method": self.name, "max_length": self.max_length}

    length = staticmethod(token.token_lengths)
    masked = staticmethod(token.without_labels)
    normalizer = staticmethod(token.label_tokens)

    def collate(self, layout: Layout) -> Batch:
        return token.collate_tokens(layout, self.tokenizer.pad_token_id)

    def prepare_model(self, model, log) -> None:
        self.loss_fn.prepare_model(model, log)

    def loss(self, model, batch: Batch) -> LossOutput:
        return self.loss_fn(model, batch)

    def pipeline_loss(self, logits, batch: Batch) -> LossOutput:
        return token.TokenLoss.from_logits(logits, batch)
