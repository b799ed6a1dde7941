"""The model an export starts from: a plain Hugging Face model, with adapters merged first.

Every format but `--merge_lora` itself reads a folder (or hub id) of full weights. A LoRA run
is merged into a temporary folder, checked against base + adapter like `--merge_lora`, and
that folder is the source.
"""

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from swiftlm.checkpoint.resolve import resolve_inference_model
from swiftlm.config import ExportConfig
from swiftlm.engine.build import InferenceModel


@dataclass(frozen=True)
class ExportSource:
    model_path: str  # a Hugging Face folder or hub id with the full (merged) weights
    tokenizer_path: str  # where the tokenizer and its chat template load from
    description: str  # one line for the console
    system: str | None  # the run's system prompt, if any (written into an Ollama Modelfile)


@contextmanager
def export_source(cfg: ExportConfig) -> Iterator[ExportSource]:
    """The source model of `cfg`; adapters are merged into a folder that lives until exit."""
    spec: InferenceModel = resolve_inference_model(cfg)
    if not spec.adapters:
        yield ExportSource(spec.base_path, spec.tokenizer_path, spec.description, spec.system)
        return
    from swiftlm.export.merge import merge_lora

    with tempfile.TemporaryDirectory(prefix="swiftlm-merged-") as folder:
        merge_lora(spec, Path(folder), cfg.export.max_shard_size)
        yield ExportSource(folder, folder, f"{spec.description}, merged", spec.system)
