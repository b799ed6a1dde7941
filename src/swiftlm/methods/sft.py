"""`swiftlm sft`: supervised fine-tuning on conversations, with loss on the assistant turns.

Rows are conversations in any format `data.formats` reads (messages, sharegpt, alpaca, ...),
tool-calling rows included (rendered with the chat template's tools, the calls trained); the
loss is the mean next-token cross-entropy over the label tokens chosen by --loss_scope.
"""

from swiftlm.config import TrainConfig
from swiftlm.data.columns import refuse_media_parts
from swiftlm.data.encode import ChatChunkEncoder, encode_chat_samples
from swiftlm.data.formats import chat_sample
from swiftlm.data.vision_batch import VISION_COLUMN
from swiftlm.data.vision_rows import vision_chat_sample
from swiftlm.methods.base import Batch, EncodeResult, Layout, LossOutput
from swiftlm.methods.token import NextTokenObjective
from swiftlm.methods.vision import VisionInputs


class SFT(NextTokenObjective):
    name = "sft"
    # `swiftlm sft` with neither --model nor --dataset: teach the packaged SmolLM2 a new name,
    # mixed with ordinary Q&A so it keeps answering other questions.
    default_datasets = ("swiftlm/self-cognition", "swiftlm/general-qa")
    supports_images = True

    def __init__(self, cfg: TrainConfig, tokenizer, vision: VisionInputs | None = None):
        # A plugin's rlhf method may build on SFT: rlhf's plugins section has neither flag.
        loss_type = getattr(cfg.plugins, "loss_type", None)
        super().__init__(
            tokenizer, cfg.train.fused_cross_entropy, loss_type, cfg.train.use_liger_kernel
        )
        self.data, self.row_format = cfg.data, getattr(cfg.plugins, "dataset_format", None)
        self.placeholders = {"{{NAME}}": cfg.model.model_name, "{{AUTHOR}}": cfg.model.model_author}
        # A vision-language model: rows may hold images, samples carry their features.
        self.vision = vision
        if vision is not None:
            self.columns = (*self.columns, VISION_COLUMN)

    def to_sample(self, record: dict) -> dict:
        """A conversation, with its tools if the row has some; columns for other methods are
        refused (see formats.chat_sample), and images unless the model takes them."""
        options = dict(
            system=self.data.system, placeholders=self.placeholders, row_format=self.row_format
        )
        if self.vision is not None:
            return vision_chat_sample(record, method=self.name, **options)
        sample = chat_sample(record, **options)
        refuse_media_parts(sample["messages"], self.name)
        return sample

    def collate(self, layout: Layout) -> Batch:
        batch = super().collate(layout)
        if self.vision is not None:
            batch.update(self.vision.batch_inputs(layout.rows, batch["input_ids"].shape[1]))
        return batch

    def loss(self, model, batch: Batch) -> LossOutput:
        if self.vision is not None:
            batch = self.vision.model_batch(model, batch)
        return super().loss(model, batch)

    def encode(self, samples: list[dict]) -> EncodeResult:
        d = self.data
        if self.vision is not None:
            return self.vision.encode(samples, d)
        encoded, truncation = encode_chat_samples(
            self.tokenizer, samples, d.max_length, d.truncation_strategy, d.loss_scope
        )
        log = [truncation.summary()] if truncation.summary() else []
        return EncodeResult(encoded, log, truncation.as_dict())

    def chunk_encoder(self) -> ChatChunkEncoder | None:
        """What encodes text conversations a chunk at a time (data.stream_encode streams them
        into the cache, in --dataset_num_proc processes); None for a vision-language model,
        whose samples are encoded whole by `encode`."""
        if self.vision is not None:
            return None
        d = self.data
        return ChatChunkEncoder(self.tokenizer, d.max_length, d.truncation_strategy, d.loss_scope)

    def cache_options(self) -> dict:
        d = self.data
        return {
            "method": self.name,
            "max_length": d.max_length,
            "truncation_strategy": d.truncation_strategy,
            "loss_scope": d.loss_scope,
            "system": d.system,
            "placeholders": list(self.placeholders.values()),
            **({"dataset_format": self.row_format} if self.row_format else {}),
            **(self.vision.cache_options() if self.vision is not None else {}),
        }
