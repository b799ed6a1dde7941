"""Resolving a training config, in two explicit steps.

- `resolve_config`, before the model loads: every default that is known by then, filled in
  one step (the method's default datasets, the learning rate, padding-free, the default run
  directory);
- `resolve_auto_batch`, once the model has loaded: `--per_device_train_batch_size auto`.

The run directory's config.yaml holds the result, so a rerun or a resume reads the values
this run used. Before either, the rules between flags (`swiftlm.config.rules`) are checked,
and `preflight.prepare_run` checks every path and settles the run directory.
"""

import dataclasses
import os
import time
from pathlib import Path

import torch

from swiftlm.checkpoint.targets import run_dir_of
from swiftlm.config import TrainConfig
from swiftlm.config.rules import Facts, pipeline
from swiftlm.distributed.config import node_range
from swiftlm.distributed.launch import launched_by_torchrun
from swiftlm.methods.vision import PACKABLE
from swiftlm.models.attention import flash_attention_available
from swiftlm.models.vision import vision_language_type
from swiftlm.train.autobatch import auto_batch_size
from swiftlm.train.config import AUTO_BATCH_SIZE
from swiftlm.train.elastic import accumulation_for, planned_shape


def launched_world() -> int:
    """The processes torchrun started (1 without torchrun)."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1


def run_facts(method_cls) -> Facts:
    """What the rules check a training config against besides its flags: the method, and the
    processes torchrun started (1 without torchrun)."""
    return Facts(world_size=launched_world(), method=method_cls)


def resolve_config(
    cfg: TrainConfig, method_cls, model_name: str, device: torch.device, log=print
) -> TrainConfig:
    """`cfg` with every unset value that is known before the model loads filled in.

    `--per_device_train_batch_size auto` stays as it is (see `resolve_auto_batch`). Assumes
    the rules hold (`dataset_given`, `resume_auto_needs_output_dir`, ...)."""
    cfg = resolve_defaults(cfg, method_cls, device)
    if cfg.train.per_device_train_batch_size != AUTO_BATCH_SIZE:
        cfg = elastic_accumulation(cfg, launched_world(), log)
    output = cfg.output
    return dataclasses.replace(
        cfg,
        output=dataclasses.replace(
            output, output_dir=output.output_dir or default_run_dir(model_name)
        ),
    )


def resolve_defaults(cfg: TrainConfig, method_cls, device: torch.device) -> TrainConfig:
    """`cfg` with the defaults of the method, the train type and the device filled in (all
    of `resolve_config` but the run directory): what a resumed run is compared on."""
    data, train = cfg.data, cfg.train
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(data, dataset=data.dataset or list(method_cls.default_datasets)),
        train=dataclasses.replace(
            train,
            learning_rate=(
                default_learning_rate(cfg.tuner.train_type)
                if train.learning_rate is None
                else train.learning_rate
            ),
            padding_free=(
                default_padding_free(cfg, device, method_cls)
                if train.padding_free is None
                else train.padding_free
            ),
        ),
    )


def default_learning_rate(train_type: str) -> float:
    """1e-5 for full fine-tuning, 1e-4 for adapters."""
    return 1e-5 if train_type == "full" else 1e-4


def default_run_dir(model_name: str) -> str:
    """output/<model name>-<timestamp>."""
    return f"output/{model_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def default_padding_free(cfg: TrainConfig, device: torch.device, method_cls) -> bool:
    """Unset --padding_free: on where dropping padding is a pure gain.

    On CPUs every padding token costs as much as a real one, and per-sample attention is as
    fast as batched; on CUDA that holds with flash-attn's varlen kernel, while without it
    per-sample SDPA calls (one host sync per layer) can cost more than the padding saves.
    Packed rows are already full, pipeline stages need fixed shapes, and some methods' samples
    cannot share a row, nor can those of the vision-language models outside PACKABLE.
    """
    fixed_shapes = cfg.train.packing or pipeline(cfg.dist) or not method_cls.supports_packing
    vision_type = vision_language_type(cfg.model.model) if cfg.model.model else None
    packable = vision_type in PACKABLE and method_cls.packs_images
    fixed_shapes = fixed_shapes or bool(vision_type and not packable)
    return not fixed_shapes and (device.type == "cpu" or flash_attention_available(device))


def _resumed_run(cfg: TrainConfig) -> Path:
    """The run whose checkpoint this run resumes: --output_dir for `auto`, else the run that
    holds the checkpoint (--output_dir when it is in none)."""
    spec, output_dir = cfg.output.resume_from_checkpoint, Path(cfg.output.output_dir)
    return output_dir if spec == "auto" else run_dir_of(Path(spec).expanduser()) or output_dir


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
    size = _previous_batch_size(_resumed_run(cfg)) if cfg.output.resume_from_checkpoint else 0
    how = "as chosen when this run started"
    if not size and ctx.is_main:
        device, dtype = placement
        size, how = auto_batch_size(
            model, loss_fn, cfg.data.max_length, device, dtype, cfg.train.gradient_checkpointing
        )
    size, how = ctx.broadcast_object((size, how))
    log(f"--per_device_train_batch_size auto: {size} ({how})")
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, per_device_train_batch_size=size)
    )
    return elastic_accumulation(cfg, ctx.world_size, log)


def elastic_accumulation(cfg: TrainConfig, world_size: int, log) -> TrainConfig:
    """An elastic job's gradient accumulation on `world_size` processes: the one that keeps
    the global batch its flags give at its largest size (`train.elastic`); a ConfigError
    when this size cannot. Other runs keep their flags."""
    if not cfg.dist.elastic:
        return cfg
    planned = planned_shape(cfg, world_size)
    accumulation = accumulation_for(planned.size, cfg, world_size)
    low, high = node_range(cfg.dist.nnodes)
    log(
        f"elastic job ({low} to {high} nodes) at world size {world_size}: gradient "
        f"accumulation {accumulation} keeps the global batch: {planned} at {high} nodes"
    )
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, gradient_accumulation_steps=accumulation)
    )
