"""`swiftlm export --to_onnx`: a causal LM as an ONNX graph for onnxruntime, checked on the way out.

The output folder is self-contained and laid out like Hugging Face Optimum's:

- `model.onnx` (the graph) and `model.onnx.data` (the float32 weights, always as external
  data: one layout for every model size, and no cliff at protobuf's 2 GB limit, which a
  ~500M-parameter model reaches in float32);
- `config.json`, `generation_config.json` and the tokenizer files with their chat template.

The graph's inputs and outputs (KV cache included) are described in `export/onnx_graph.py`.
The export checks itself before it returns (`export/onnx_check.py`): the graph, read back
from disk with onnxruntime, must reproduce the torch model's logits and greedy answers.
"""

import importlib
import inspect
import logging
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from swiftlm.config import ExportConfig
from swiftlm.errors import ConfigError
from swiftlm.export.onnx_check import check_export
from swiftlm.export.onnx_graph import (
    FALLBACK_HINT,
    CausalLMWithCache,
    OnnxExportError,
    dynamic_axes,
    exporter_summary,
    input_names,
    output_names,
    trace_example,
)
from swiftlm.export.source import ExportSource
from swiftlm.models.loader import load_model, load_tokenizer

ONNX_FILE = "model.onnx"
REQUIRED_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
INSTALL_HINT = "pip install 'swiftlm[onnx]'"


def validate(cfg: ExportConfig) -> None:
    """Fail fast, before any model loads, on what the installed packages cannot do for
    --to_onnx (its --torch_dtype is the rule `onnx_float32`)."""
    missing = [name for name in REQUIRED_PACKAGES if not _importable(name)]
    if missing:
        raise ConfigError(
            f"--to_onnx needs {', '.join(missing)}, which could not be imported; install the "
            f"onnx extra with `{INSTALL_HINT}`"
        )
    if "dynamo" not in inspect.signature(torch.onnx.export).parameters:
        raise ConfigError(
            f"--to_onnx needs torch's dynamo exporter, which torch {torch.__version__} lacks; "
            "upgrade torch (2.6 or newer)"
        )


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def export(source: ExportSource, out: Path, cfg: ExportConfig) -> dict:
    """Export `source` to `out/model.onnx`, copy its config and tokenizer next to it, check the
    file with onnxruntime against the torch model, and return a report."""
    print(f"Loading {source.description} (float32, CPU)", flush=True)
    tokenizer = load_tokenizer(source.tokenizer_path)
    model = load_model(source.model_path, torch.float32, torch.device("cpu"), cfg.model.attn_impl)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    onnx_path = out / ONNX_FILE
    started = time.perf_counter()
    export_graph(model, onnx_path, source.description)
    export_seconds = time.perf_counter() - started
    _write_companions(model, tokenizer, out)
    size = onnx_bytes(onnx_path)
    print(
        f"ONNX model written to {onnx_path} ({len(onnx_files(onnx_path))} files, "
        f"{size / 1e6:.1f} MB, KV cache in/out) in {export_seconds:.1f} s",
        flush=True,
    )
    report = check_export(model, tokenizer, onnx_path)
    report.update(output=str(onnx_path), bytes=size, export_seconds=round(export_seconds, 2))
    return report


# --- the export ---------------------------------------------------------------------------


def export_graph(model, onnx_path: Path, model_name: str) -> None:
    """Trace `model` with torch's dynamo exporter into `onnx_path` (+ external data)."""
    example = trace_example(model, model_name)
    layers = len(example["past_key_values"]) // 2
    try:
        with _quiet_exporter():
            torch.onnx.export(
                CausalLMWithCache(model).eval(),
                (),
                str(onnx_path),
                kwargs=example,
                dynamo=True,
                input_names=input_names(model, layers),
                output_names=output_names(layers),
                dynamic_shapes=dynamic_axes(example),
                external_data=True,
                verbose=False,
            )
    except torch.onnx.errors.OnnxExporterError as exc:  # graph capture or conversion failed
        raise OnnxExportError(
            f"could not export {model_name} to ONNX: torch {torch.__version__}'s exporter "
            f"failed ({exporter_summary(exc)}): this model's code is not traceable by "
            f"torch.export. {FALLBACK_HINT}"
        ) from exc


# The exporter logs graph dumps and warnings about optional packages (torchvision) and axis
# names while it works; the user's terminal gets swiftlm's summary lines instead, and a failure
# still carries the full text in the exception chain.
NOISY_LOGGERS = ("torch.onnx", "torch.export", "torch._export", "torch._dynamo", "torch.fx")


@contextmanager
def _quiet_exporter() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


def _write_companions(model, tokenizer, out: Path) -> None:
    """config.json, generation_config.json and the tokenizer (with its chat template), so the
    folder is all a runtime needs."""
    model.config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def onnx_files(onnx_path: Path) -> list[Path]:
    """The graph and its external data file(s), as the exporter named them."""
    return sorted(onnx_path.parent.glob(onnx_path.name + "*"))


def onnx_bytes(onnx_path: Path) -> int:
    return sum(path.stat().st_size for path in onnx_files(onnx_path))
