"""`swiftlm infer`: chat with a model, or answer every prompt of `--val_dataset` into a file."""

from swiftlm.config import InferConfig
from swiftlm.errors import ConfigError
from swiftlm.infer.batch import run_batch
from swiftlm.infer.chat import run_chat
from swiftlm.infer.engine import build_engine, check_generation_args
from swiftlm.infer.resolve import resolve_inference_model


def run(cfg: InferConfig) -> list[dict] | None:
    """Run inference; returns the batch results, or None after an interactive chat."""
    check_flags(cfg)
    spec = resolve_inference_model(cfg)
    print(f"Loading {spec.description}", flush=True)
    engine = build_engine(spec, cfg.model, cfg.infer.seed)
    if cfg.data.val_dataset:
        return run_batch(engine, cfg, spec)
    run_chat(engine, cfg.generation, system=spec.system, stream=cfg.infer.stream)
    return None


def check_flags(cfg: InferConfig) -> None:
    """Catch bad flag values before spending time on loading the model."""
    check_generation_args(cfg.generation)
    if cfg.infer.max_batch_size < 1:
        raise ConfigError(f"--max_batch_size {cfg.infer.max_batch_size} must be at least 1")
    if cfg.data.dataset and not cfg.data.val_dataset:
        raise ConfigError(
            "swiftlm infer reads prompts from --val_dataset, not --dataset; "
            f"use --val_dataset {' '.join(cfg.data.dataset)}"
        )
    if cfg.infer.result_path and not cfg.data.val_dataset:
        raise ConfigError("--result_path is for batch mode; give the prompts with --val_dataset")
