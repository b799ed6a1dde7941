"""The manifest of an evaluation: everything needed to reproduce it to the sample.

Scores drift between tools and versions when the prompt, the template, the extraction or the
metric change silently. The manifest pins each of them: the model's and adapters' weight
hashes, the chat template's hash, the sampling settings and seed, every task's data hash,
kind, metrics and extraction rule, the library versions, and the resolved config (rerun with
`swiftlm eval --config <eval dir>/config.yaml`).
"""

import hashlib
import importlib.metadata
import platform
import sys
from dataclasses import asdict
from pathlib import Path

from swiftlm.evaluation.tasks import Task

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
LIBRARIES = ("swiftlm", "torch", "transformers", "peft", "lm_eval", "rouge-score", "sacrebleu")


def weights_sha256(folder: str) -> str | None:
    """One hash over a folder's weight files (names and bytes, sorted); None for a hub id."""
    path = Path(folder)
    if not path.is_dir():
        return None
    digest = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES):
        digest.update(file.name.encode())
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


def text_sha256(text: str | None) -> str | None:
    return hashlib.sha256(text.encode()).hexdigest() if text else None


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def local_model_entry(spec, engine) -> dict:
    """The loaded model: `torch_dtype` as asked (auto ...) and `compute_dtype` as resolved, since
    greedy answers in bfloat16 can depend on how requests were batched."""
    tokenizer = engine.tokenizer
    return {
        "description": spec.description,
        "base": spec.base_path,
        "base_sha256": weights_sha256(spec.base_path),
        "adapters": [{"path": a, "sha256": weights_sha256(a)} for a in spec.adapters],
        "tokenizer": spec.tokenizer_path,
        "chat_template_sha256": text_sha256(getattr(tokenizer, "chat_template", None)),
        "torch_dtype": spec.torch_dtype,
        "compute_dtype": compute_dtype(engine),
        "infer_backend": "pt" if engine.model is not None else "vllm",
        "system": spec.system,
    }


def compute_dtype(engine) -> str:
    """The dtype the engine's weights run in: of the torch model, or vLLM's (`dtype`)."""
    if engine.model is None:
        return engine.dtype
    return str(next(engine.model.parameters()).dtype).replace("torch.", "")


def endpoint_model_entry(backend) -> dict:
    return {"description": backend.description, "url": backend.base_url, "model": backend.model}


def task_entry(task: Task, prompt_format: str) -> dict:
    return {
        "kind": task.kind,
        "source": task.source,
        "source_sha256": task.source_sha256,
        "samples": len(task.samples),
        "metrics": list(task.metrics),
        "extraction": task.extraction,
        "max_new_tokens": task.max_new_tokens,
        "system": task.system,
        "prompt_format": prompt_format,
    }


def build_manifest(*, model: dict, sampling, tasks: dict, backend: str, started: str) -> dict:
    return {
        "command": ["swiftlm", *sys.argv[1:]] if sys.argv else [],
        "started": started,
        "backend": backend,
        "model": model,
        "sampling": asdict(sampling),
        "seed": sampling.seed,
        "tasks": tasks,
        "versions": library_versions(),
    }
