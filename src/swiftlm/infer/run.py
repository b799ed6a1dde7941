"""`swiftlm infer`: chat with a model, or answer every prompt of `--val_dataset` into a file
(`--task score`: write each conversation's reward instead, with a reward model)."""

from swiftlm.checkpoint.resolve import resolve_inference_model
from swiftlm.checkpoint.targets import check_weights_folders
from swiftlm.config import InferConfig
from swiftlm.config.paths import check_writable_file
from swiftlm.config.rules import check
from swiftlm.data.sources import check_dataset_paths
from swiftlm.engine.build import EngineOptions
from swiftlm.engine.vision import is_vision_model
from swiftlm.infer.batch import load_prompts, run_batch
from swiftlm.infer.chat import run_chat
from swiftlm.infer.chat_images import check_images
from swiftlm.infer.frontend import build_chat_engine
from swiftlm.infer.score import check_task, run_scoring


def check_paths(cfg: InferConfig) -> None:
    """The folders, prompts and results file the flags name, before the model loads."""
    check_weights_folders(cfg.infer.ckpt_dir, cfg.infer.adapters)
    check_dataset_paths(cfg.data)
    if cfg.infer.result_path:
        check_writable_file(cfg.infer.result_path, "--result_path")


def run(cfg: InferConfig) -> list[dict] | None:
    """Run inference; returns the batch (or score) results, or None after an interactive chat."""
    check(cfg)  # every rule between flags, before the model loads
    check_paths(cfg)
    spec = resolve_inference_model(cfg)
    check_task(cfg.infer.task, spec)
    if cfg.infer.task == "score":
        return run_scoring(cfg, spec)
    images = check_images(cfg.infer.images, spec)
    # A vision-language model's rows may hold images: each is checked here, before loading.
    samples = None
    if cfg.data.val_dataset and is_vision_model(spec.base_path):
        samples = load_prompts(cfg, spec.system, vision=True)
    print(f"Loading {spec.description}", flush=True)
    engine = build_chat_engine(
        spec, cfg.model, cfg.infer.seed, cfg.infer.max_batch_size, spec.max_pixels,
        options=EngineOptions.of(cfg.infer),
    )  # fmt: skip
    try:
        if cfg.data.val_dataset:
            return run_batch(engine, cfg, spec, samples)
        run_chat(engine, cfg.generation, system=spec.system, stream=cfg.infer.stream, images=images)
        return None
    finally:
        engine.shutdown()
