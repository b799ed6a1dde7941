"""What a method needs to train a vision-language model: its processor, encoding with images,
and the image inputs of a micro-batch. SFT and DPO build on it (`supports_images`).

The encoded samples gain one column, `vision` (each sample's image features as safetensors
bytes, data.vision_batch), so the tokenized-data cache keeps the preprocessed features and a
second run with the same data and processor skips image preprocessing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from swiftlm.data.cache import CachedLine
from swiftlm.data.collate import IMAGE_INPUTS
from swiftlm.data.encode import TruncationReport
from swiftlm.data.vision_batch import collate_image_features
from swiftlm.data.vision_encode import encode_vision_samples
from swiftlm.data.vision_rows import local_image_files
from swiftlm.methods.base import EncodeResult
from swiftlm.methods.vision_positions import (
    TOKEN_TYPES,
    packed_mrope_positions,
    rope_index_owner,
)
from swiftlm.models.vision import PER_SAMPLE_IMAGE_AXIS, image_token_ids

# Vision-language models whose packed rows swiftlm builds: restarting positions (Qwen2-VL's
# with per-sample multimodal rotary positions, methods.vision_positions) and image features
# in the order of their image tokens (data.vision_batch). Others train on padded rows.
PACKABLE = ("llava", "idefics3", "smolvlm", "qwen2_vl")
# Model types whose packed rows need multimodal rotary positions (methods.vision_positions).
MROPE_TYPES = ("qwen2_vl",)


@dataclass
class VisionInputs:
    """A vision-language model's processor and how its image inputs are batched."""

    processor: object
    model_type: str
    max_pixels: int = 0
    workers: int = 1  # --dataset_num_proc: processes that preprocess images (SFT)
    image_ids: set[int] = field(init=False)
    _rope_owner: object = field(init=False, default=None, repr=False)

    def __post_init__(self):
        self.image_ids = image_token_ids(self.processor)

    def encode(self, samples: list[dict], data, scope: str | None = None) -> EncodeResult:
        """Encoded samples with the `vision` column, the truncation and throughput lines."""
        encoded, report, throughput = encode_vision_samples(
            self.processor,
            samples,
            data.max_length,
            data.truncation_strategy,
            scope or data.loss_scope,
            self.image_ids,
            self.max_pixels,
            self.workers,
        )
        lines = self.lines(report, throughput)
        return EncodeResult(encoded, lines, report.as_dict(), local_image_files(samples))

    def lines(self, report: TruncationReport, throughput) -> list[str]:
        # The throughput is this run's: a cached run says it skipped the preprocessing.
        summary = CachedLine(throughput.summary(self.processor), throughput.cached_summary())
        lines = [summary] if throughput.images else []
        return lines + ([report.summary()] if report.summary() else [])

    def batch_inputs(self, rows: list[list[dict]], width: int) -> dict[str, torch.Tensor]:
        """The micro-batch's image inputs, under data.collate.IMAGE_INPUTS names, for token
        rows of `width` holding `rows`' samples (one each, or packed)."""
        axis = PER_SAMPLE_IMAGE_AXIS.get(self.model_type, ())
        features = collate_image_features(rows, width, axis)
        return {IMAGE_INPUTS + name: value for name, value in features.items()}

    def model_batch(self, model, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`batch` as the model takes it: a packed Qwen2-VL batch gets its per-sample
        multimodal rotary positions (methods.vision_positions)."""
        packed = "position_ids" in batch and "attention_mask" not in batch
        if not (packed and self.model_type in MROPE_TYPES and TOKEN_TYPES in batch):
            return batch
        if self._rope_owner is None:
            self._rope_owner = rope_index_owner(model)
        return {**batch, "position_ids": packed_mrope_positions(self._rope_owner, batch)}

    def cache_options(self) -> dict:
        """What the features depend on besides the tokenizer: the image processor's settings,
        and the processor's own (how many tokens an image becomes: LLaVA's patch_size,
        Idefics3's image_seq_len ...)."""
        image_processor = self.processor.image_processor
        return {
            "image_processor": type(image_processor).__name__,
            "image_processor_config": image_processor.to_json_string(),
            "processor": type(self.processor).__name__,
            "processor_config": processor_settings(self.processor),
            "processor_template": getattr(self.processor, "chat_template", None) or "",
            "max_pixels": self.max_pixels,
        }


# Parts of a processor's to_dict() that cache_options keys on their own, or that are no
# setting of how images become tokens.
KEYED_APART = ("image_processor", "video_processor", "tokenizer", "chat_template")


def processor_settings(processor) -> str:
    """The processor's own settings as JSON (its image processor and template are apart)."""
    try:
        settings = processor.to_dict()
    except Exception:  # noqa: BLE001 - a processor that cannot serialize: its plain attributes
        settings = {
            name: value
            for name, value in vars(processor).items()
            if isinstance(value, int | float | str | bool)
        }
    kept = {name: value for name, value in settings.items() if name not in KEYED_APART}
    return json.dumps(kept, sort_keys=True, default=str)
