"""Work out what a model, run or adapter flag loads: a base model, adapters on it, a tokenizer,
a system prompt, for `swiftlm infer`, `deploy`, `eval` and `export`. The result, an
`engine.build.InferenceModel`, is what an engine is built from.

The user points at a model in one of these ways:

- `--model M`: a Hugging Face folder, hub id or .gguf file (the packaged default when absent);
- `--model M --adapters A [B ...]`: LoRA/DoRA adapter folders applied on M;
- `--ckpt_dir D` (or a single `--adapters D`) where D is a swiftlm run directory (its
  `final/` is used), that `final/` folder, a `checkpoints/step-N` folder, or any peft
  adapter / Hugging Face model folder.

An adapter's base model comes from `--model` when given, else from the run's `config.yaml`,
else from `adapter_config.json`. A run's system prompt, dtype and --max_pixels are inherited
unless the user sets them.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from swiftlm.checkpoint.blocks import is_block_checkpoint
from swiftlm.checkpoint.folders import is_complete, list_checkpoints
from swiftlm.checkpoint.targets import ADAPTER_CONFIG, MODEL_CONFIG, RUN_CONFIG
from swiftlm.config import InferConfig, TrainConfig
from swiftlm.config.parse import load_run_config
from swiftlm.engine.build import InferenceModel
from swiftlm.errors import CheckpointError, ConfigError, ModelLoadError, SwiftLMError
from swiftlm.models.loader import resolve_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class _Checkpoint:
    """A folder holding weights, and the swiftlm run it belongs to (if any)."""

    flag: str  # "--ckpt_dir X" or "--adapters X": names the input in error messages
    folder: Path
    run_dir: Path | None
    run_config: TrainConfig | None

    @property
    def is_adapter(self) -> bool:
        return (self.folder / ADAPTER_CONFIG).is_file()


def resolve_inference_model(cfg: InferConfig) -> InferenceModel:
    """Resolve the model flags of `cfg` into an `InferenceModel`; raise a clear error if bad.
    The flags have passed `rules.check` (--ckpt_dir and --adapters are not both given)."""
    _reject_run_dir_as_model(cfg.model.model)
    if cfg.infer.ckpt_dir:
        checkpoints = [_locate_checkpoint(cfg.infer.ckpt_dir, "--ckpt_dir")]
    else:
        checkpoints = [_locate_checkpoint(a, "--adapters") for a in cfg.infer.adapters]
    if not checkpoints:
        base = resolve_model(cfg.model.model)
        return InferenceModel(
            base.path,
            (),
            base.path,
            cfg.data.system,
            cfg.model.torch_dtype,
            base.requested,
            base_name=base.name,
            max_pixels=cfg.data.max_pixels,
        )
    full = [c for c in checkpoints if not c.is_adapter]
    if full:
        return _full_model(cfg, full[0], len(checkpoints))
    return _adapters_on_base(cfg, checkpoints)


def _full_model(cfg: InferConfig, ckpt: _Checkpoint, count: int) -> InferenceModel:
    if count > 1:
        raise ConfigError(
            f"{ckpt.flag}: {ckpt.folder} holds a full model (config.json), not an adapter; "
            "pass it alone as --ckpt_dir"
        )
    if cfg.model.model is not None:
        raise ConfigError(
            f"{ckpt.flag}: {ckpt.folder} holds a full model, so --model {cfg.model.model} has "
            "nothing to apply to; drop --model"
        )
    path = str(ckpt.folder.resolve())
    return InferenceModel(
        base_path=path,
        adapters=(),
        tokenizer_path=path,
        system=_inherit_system(cfg, ckpt),
        torch_dtype=_inherit_dtype(cfg, ckpt),
        description=f"full model {ckpt.folder}",
        ckpt_dir=_results_root(ckpt),
        max_pixels=_inherit_max_pixels(cfg, ckpt),
    )


def _adapters_on_base(cfg: InferConfig, checkpoints: list[_Checkpoint]) -> InferenceModel:
    first = checkpoints[0]
    base = _resolve_base(cfg, first)
    tokenizer = next((str(c.folder) for c in checkpoints if _has_tokenizer(c.folder)), base.path)
    names = ", ".join(str(c.folder) for c in checkpoints)
    return InferenceModel(
        base_path=base.path,
        adapters=tuple(str(c.folder.resolve()) for c in checkpoints),
        tokenizer_path=tokenizer,
        system=_inherit_system(cfg, first),
        torch_dtype=_inherit_dtype(cfg, first),
        description=f"{base.requested} + adapter {names}",
        ckpt_dir=_results_root(first),
        base_name=base.name,
        max_pixels=_inherit_max_pixels(cfg, first),
    )


def _resolve_base(cfg: InferConfig, ckpt: _Checkpoint):
    """The adapter's base: --model, else the run's config.yaml, else adapter_config.json."""
    if cfg.model.model is not None:
        return resolve_model(cfg.model.model)
    if ckpt.run_config is not None:
        model, source = ckpt.run_config.model.model, ckpt.run_dir / RUN_CONFIG
    else:
        model, source = _adapter_base(ckpt), ckpt.folder / ADAPTER_CONFIG
    try:
        return resolve_model(model)
    except ModelLoadError as exc:
        raise ModelLoadError(
            f"{ckpt.flag}: the base model {model!r} (read from {source}) cannot be used: {exc}. "
            "Pass the base model with --model"
        ) from None


def _adapter_base(ckpt: _Checkpoint) -> str:
    config_file = ckpt.folder / ADAPTER_CONFIG
    try:
        base = json.loads(config_file.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{ckpt.flag}: cannot read {config_file}: {exc}") from None
    if not base:
        raise ModelLoadError(
            f"{ckpt.flag}: {config_file} does not name its base model "
            "(base_model_name_or_path); pass the base model with --model"
        )
    return base


def _locate_checkpoint(path: str, flag: str) -> _Checkpoint:
    """Map a run dir / final / checkpoint / plain folder to the folder holding the weights."""
    folder = Path(path).expanduser()
    flag = f"{flag} {path}"
    if not folder.is_dir():
        raise ModelLoadError(f"{flag}: no such folder")
    if (folder / RUN_CONFIG).is_file() and not _has_weights(folder):
        folder = _final_of_run(folder, flag)
    elif folder.parent.name == "checkpoints" and not is_complete(folder):
        raise CheckpointError(
            f"{flag}: this checkpoint is incomplete (no COMPLETE marker: the run stopped while "
            f"saving it). {_complete_list(folder.parent.parent)}"
        )
    if not _has_weights(folder):
        raise ModelLoadError(
            f"{flag}: {folder} has neither {ADAPTER_CONFIG} nor {MODEL_CONFIG}; expected a "
            "swiftlm run directory, its final/ folder, a checkpoint, a peft adapter folder or "
            "a Hugging Face model folder"
        )
    if is_block_checkpoint(folder):
        raise CheckpointError(_block_format_message(flag, folder))
    run_dir = _run_dir_of(folder)
    run_config = _load_run_config(run_dir, flag) if run_dir else None
    return _Checkpoint(flag, folder, run_dir, run_config)


def _block_format_message(flag: str, folder: Path) -> str:
    """A block-format checkpoint holds a manifest, not weights transformers/peft can load."""
    run = folder.parent.parent if folder.parent.name == "checkpoints" else None
    final = f" or the run's final weights (--ckpt_dir {run})" if run is not None else ""
    return (
        f"{flag}: {folder} is an incremental checkpoint (--incremental_checkpoints true: its "
        "tensors are blocks in the run's checkpoints/blocks/, listed in blocks.json), which "
        f"only a training run resumes from; load a checkpoint saved without it{final}, or "
        f"resume training from it with --resume_from_checkpoint {folder}"
    )


def _final_of_run(run_dir: Path, flag: str) -> Path:
    final = run_dir / "final"
    if final.is_dir() and _has_weights(final):
        return final
    raise CheckpointError(
        f"{flag}: the run has no final/ model (training did not finish?). {_complete_list(run_dir)}"
    )


def _complete_list(run_dir: Path) -> str:
    complete, _ = list_checkpoints(run_dir)
    if not complete:
        return f"{run_dir} has no complete checkpoint either; nothing to load"
    names = ", ".join(str(p) for p in complete)
    return f"Complete checkpoints: {names}; pass one as --ckpt_dir, e.g. --ckpt_dir {complete[-1]}"


def _run_dir_of(folder: Path) -> Path | None:
    """The swiftlm run a weights folder belongs to: `<run>/final` or `<run>/checkpoints/step-N`."""
    if folder.name == "final":
        candidate = folder.parent
    elif folder.parent.name == "checkpoints":
        candidate = folder.parent.parent
    else:
        candidate = folder
    return candidate if (candidate / RUN_CONFIG).is_file() else None


def _load_run_config(run_dir: Path, flag: str) -> TrainConfig:
    try:
        return load_run_config(run_dir / RUN_CONFIG)
    except SwiftLMError as exc:
        raise ConfigError(
            f"{flag}: cannot read the run's {run_dir / RUN_CONFIG}: {exc}. Pass the base model "
            "with --model and the adapter folder with --adapters instead"
        ) from None


def _reject_run_dir_as_model(model: str | None) -> None:
    # A run directory has config.yaml but no config.json; resolve_model would only say the
    # latter is missing, so point at the flag that reads runs.
    if model and (Path(model) / RUN_CONFIG).is_file() and not _has_weights(Path(model)):
        raise ConfigError(
            f"--model {model} is a swiftlm run directory; load it with --ckpt_dir {model}"
        )


def _has_weights(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file() or (folder / MODEL_CONFIG).is_file()


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def _inherit_system(cfg: InferConfig, ckpt: _Checkpoint) -> str | None:
    if cfg.data.system is not None or ckpt.run_config is None:
        return cfg.data.system
    return ckpt.run_config.data.system


def _inherit_dtype(cfg: InferConfig, ckpt: _Checkpoint) -> str:
    if cfg.model.torch_dtype != "auto" or ckpt.run_config is None:
        return cfg.model.torch_dtype
    return ckpt.run_config.model.torch_dtype


def _inherit_max_pixels(cfg: InferConfig, ckpt: _Checkpoint) -> int:
    """Images are scaled as in training unless the user sets --max_pixels."""
    if cfg.data.max_pixels or ckpt.run_config is None:
        return cfg.data.max_pixels
    return getattr(ckpt.run_config.data, "max_pixels", 0)


def _results_root(ckpt: _Checkpoint) -> str:
    return str(ckpt.run_dir or ckpt.folder)
