"""What a method needs to train a vision-language model: its processor, encoding with images,
and the image inputs of a micro-batch. SFT and DPO build on it (`supports_images`).

The encoded samples gain one column, `vision` (each sample's image features as safetensors
bytes, data.vision_batch), so the tokenized-data cache keeps the preprocessed features and a
second run with the same data and processor skips image preprocessing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swiftlm.data.collate import IMAGE_INPUTS
from swiftlm.data.encode import TruncationReport
from swiftlm.data.vision_batch import VISION_COLUMN, collate_features
from swiftlm.data.vision_encode import encode_vision_samples
from swiftlm.methods.base import EncodeResult
from swiftlm.models.vision import PER_SAMPLE_IMAGE_AXIS, image_token_ids


@dataclass
class VisionInputs:
    """A vision-language model's processor and how its image inputs are batched."""

    processor: object
    model_type: str
    max_pixels: int = 0
    image_ids: set[int] = field(init=False)

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
        )
        return EncodeResult(encoded, self.lines(report, throughput), report.as_dict())

    def lines(self, report: TruncationReport, throughput) -> list[str]:
        lines = [throughput.summary(self.processor)] if throughput.images else []
        return lines + ([report.summary()] if report.summary() else [])

    def batch_inputs(self, samples: list[dict], width: int) -> dict[str, torch.Tensor]:
        """The micro-batch's image inputs, under data.collate.IMAGE_INPUTS names."""
        axis = PER_SAMPLE_IMAGE_AXIS.get(self.model_type, ())
        features = collate_features([s[VISION_COLUMN] for s in samples], width, axis)
        return {IMAGE_INPUTS + name: value for name, value in features.items()}

    def cache_options(self) -> dict:
        """What the features depend on besides the tokenizer: the image processor's settings."""
        image_processor = self.processor.image_processor
        return {
            "image_processor": type(image_processor).__name__,
            "image_processor_config": image_processor.to_json_string(),
            "processor_template": getattr(self.processor, "chat_template", None) or "",
            "max_pixels": self.max_pixels,
        }
