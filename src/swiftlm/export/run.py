"""`swiftlm export`: write a model for serving elsewhere, and check it before returning.

One format per command:

- `--merge_lora`: adapters merged into a full Hugging Face folder (`export/merge.py`);
- `--to_gguf` (`--to_ollama` adds a Modelfile): one GGUF file (`export/gguf.py`);
- `--quant_method bnb|int8|int4|gptq|awq`: a quantized Hugging Face folder
  (`export/quantize.py`);
- `--to_onnx`: an ONNX model (`export/onnx.py`);
- `--merge_models`: several fine-tunes of --model merged into one (`export/model_merge.py`).

A LoRA run is merged first for every format (`export/source.py`).
"""

import importlib
from pathlib import Path

from swiftlm.checkpoint.targets import check_weights_folders
from swiftlm.config import ExportConfig
from swiftlm.config.paths import check_writable_folder
from swiftlm.config.rules import check
from swiftlm.config.rules_export import export_formats
from swiftlm.data.sources import check_dataset_paths
from swiftlm.errors import ConfigError


def chosen_format(cfg: ExportConfig) -> str:
    """The one output format the flags ask for (`rules.check` has made sure there is one)."""
    formats = export_formats(cfg)
    return formats[0] if formats else "merged"


def output_folder(cfg: ExportConfig) -> Path:
    """--output_dir, which must be new or empty unless --overwrite_output_dir true (that it
    is given is a rule; that it holds no input, `config/outputs.py`)."""
    check_writable_folder(cfg.export.output_dir, "--output_dir")
    out = Path(cfg.export.output_dir)
    if out.exists() and any(out.iterdir()) and not cfg.overwrite.overwrite_output_dir:
        raise ConfigError(
            f"--output_dir {out} is not empty; choose a new folder, or add "
            "--overwrite_output_dir true to write into it"
        )
    return out


def _export_merged(cfg: ExportConfig, out: Path) -> dict:
    from swiftlm.checkpoint.resolve import resolve_inference_model
    from swiftlm.export.merge import merge_lora

    spec = resolve_inference_model(cfg)
    if not spec.adapters:
        raise ConfigError(
            "--merge_lora needs adapters: pass a LoRA run with --ckpt_dir, or --adapters "
            "(with --model for their base model)"
        )
    return merge_lora(spec, out, cfg.export.max_shard_size)


# Each format's module has validate(cfg), run after the flag rules and before anything loads
# (what the device and the installed packages allow), and export(source, out, cfg) -> report,
# which writes `out` and checks what it wrote.
FORMAT_MODULES = {
    "gguf": "swiftlm.export.gguf",
    "quantized": "swiftlm.export.quantize",
    "onnx": "swiftlm.export.onnx",
}


def run(cfg: ExportConfig) -> dict:
    check(cfg)  # every rule between flags, before anything loads
    check_weights_folders(cfg.infer.ckpt_dir, cfg.infer.adapters)
    check_dataset_paths(cfg.data)  # calibration data, read after the model loads
    fmt = chosen_format(cfg)
    out = output_folder(cfg)
    if fmt == "merged":
        return _export_merged(cfg, out)
    if fmt == "merged_models":
        from swiftlm.export.model_merge import merge_models

        return merge_models(cfg, out)
    module = importlib.import_module(FORMAT_MODULES[fmt])
    module.validate(cfg)
    from swiftlm.export.source import export_source

    with export_source(cfg) as source:
        return module.export(source, out, cfg)
