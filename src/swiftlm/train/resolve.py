"""Checks and defaults of a training config that depend on the method, the model or the
machine: flag combinations, learning rate, run directory, default data, padding-free and
`--per_device_train_batch_size auto`."""

import dataclasses
import os
import time
from pathlib import Path

import torch

from swiftlm.config import TrainConfig
from swiftlm.errors import ConfigError
from swiftlm.models.attention import flash_attention_available
from swiftlm.models.quant import quantized_training_problems
from swiftlm.train.autobatch import auto_batch_size


def check_config(cfg: TrainConfig) -> None:
    """Cross-field checks that argparse cannot express."""
    d, t, o = cfg.data, cfg.train, cfg.output
    problems = [
        (d.max_length < 2, "--max_length must be at least 2"),
        (not 0 <= d.split_dataset_ratio < 1, "--split_dataset_ratio must be in [0, 1)"),
        (
            t.per_device_train_batch_size < 0,
            "--per_device_train_batch_size must be >= 1, or auto",
        ),
        (
            0 < t.max_tokens_per_batch < d.max_length,
            f"--max_tokens_per_batch {t.max_tokens_per_batch} is below --max_length "
            f"{d.max_length}: the longest samples would not fit; raise it or lower --max_length",
        ),
        (
            cfg.dist.pipeline_parallel_size > 1
            and (t.packing or t.padding_free or t.max_tokens_per_batch > 0),
            "--packing, --padding_free and --max_tokens_per_batch are not available with "
            "--pipeline_parallel_size (its stages need fixed shapes)",
        ),
        (t.gradient_accumulation_steps < 1, "--gradient_accumulation_steps must be >= 1"),
        (
            t.max_steps <= 0 and t.num_train_epochs <= 0,
            "set --num_train_epochs > 0 or --max_steps > 0",
        ),
        (cfg.tuner.lora_rank < 1, "--lora_rank must be >= 1"),
        (o.logging_steps < 1 or o.save_steps < 1, "--logging_steps and --save_steps must be >= 1"),
        (not 0 <= t.warmup_ratio <= 1, "--warmup_ratio must be in [0, 1]"),
        (
            cfg.dist.pipeline_parallel_size > 1 and (d.val_dataset or d.split_dataset_ratio > 0),
            "evaluation is not available with --pipeline_parallel_size yet; drop --val_dataset "
            "and --split_dataset_ratio",
        ),
    ]
    problems += quantized_training_problems(cfg)
    for failed, message in problems:
        if failed:
            raise ConfigError(message)


def resolve_defaults(cfg: TrainConfig, method_cls, model_name: str) -> TrainConfig:
    """Fill what depends on other options: learning rate, run directory, default data."""
    cfg = dataclasses.replace(cfg)
    if not cfg.data.dataset:
        if not method_cls.default_datasets or cfg.model.model is not None:
            raise ConfigError(
                "--dataset is required (a .jsonl/.json/.csv/.parquet/.txt file or hub id)"
            )
        cfg.data = dataclasses.replace(cfg.data, dataset=list(method_cls.default_datasets))
    if cfg.train.learning_rate is None:
        lr = 1e-5 if cfg.tuner.train_type == "full" else 1e-4
        cfg.train = dataclasses.replace(cfg.train, learning_rate=lr)
    if cfg.output.output_dir is None:
        if cfg.output.resume_from_checkpoint == "auto":
            raise ConfigError("--resume_from_checkpoint auto needs the --output_dir of the run")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        cfg.output = dataclasses.replace(cfg.output, output_dir=f"output/{model_name}-{stamp}")
    if not method_cls.supports_packing and (cfg.train.packing or cfg.train.padding_free):
        raise ConfigError(
            f"--packing and --padding_free are not available with {method_cls.name}: its "
            "samples cannot share a row; drop the flags"
        )
    return cfg


def _previous_batch_size(run_dir: Path) -> int:
    """The batch size a resumed run chose before (0: unknown)."""
    import yaml

    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return 0
    train = (yaml.safe_load(saved.read_text()) or {}).get("train", {})
    return int(train.get("per_device_train_batch_size") or 0)


def resolve_auto_batch(cfg: TrainConfig, model, loss_fn, placement, ctx, log) -> TrainConfig:
    """Replace `--per_device_train_batch_size auto` by a number (rank 0's, for all ranks).

    A resumed run keeps the size it chose first: the data order depends on it."""
    size = (
        _previous_batch_size(Path(cfg.output.output_dir))
        if cfg.output.resume_from_checkpoint
        else 0
    )
    how = "as chosen when this run started"
    if not size and ctx.is_main:
        device, dtype = placement
        size, how = auto_batch_size(
            model, loss_fn, cfg.data.max_length, device, dtype, cfg.train.gradient_checkpointing
        )
    size, how = ctx.broadcast_object((size, how))
    log(f"--per_device_train_batch_size auto: {size} ({how})")
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, per_device_train_batch_size=size)
    )


def resolve_padding_free(cfg: TrainConfig, device: torch.device, method_cls) -> TrainConfig:
    """Unset --padding_free: on where dropping padding is a pure gain.

    On CPUs every padding token costs as much as a real one, and per-sample attention is as
    fast as batched; on CUDA that holds with flash-attn's varlen kernel, while without it
    per-sample SDPA calls (one host sync per layer) can cost more than the padding saves.
    Packed rows are already full, pipeline stages need fixed shapes, and some methods' samples
    cannot share a row.
    """
    if cfg.train.padding_free is not None:
        return cfg
    fixed_shapes = (
        cfg.train.packing or cfg.dist.pipeline_parallel_size > 1 or not method_cls.supports_packing
    )
    on = not fixed_shapes and (device.type == "cpu" or flash_attention_available(device))
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, padding_free=on))


def resume_after_restart(cfg: TrainConfig) -> TrainConfig:
    """A worker restarted by torchrun (--max_restarts) resumes from the newest checkpoint."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return cfg
    return dataclasses.replace(
        cfg, output=dataclasses.replace(cfg.output, resume_from_checkpoint="auto")
    )
