"""Resolving a training config, in two explicit steps.

- `resolve_config`, before the model loads: every default that is known by then, filled in
  one step (the method's default datasets, the learning rate, the run directory, resume
  after a torchrun restart, padding-free);
- `resolve_auto_batch`, once the model has loaded: `--per_device_train_batch_size auto`.

The run directory's config.yaml holds the result, so a rerun or a resume reads the values
this run used. The rules between flags (`swiftlm.config.rules`) are checked before either.
"""

import dataclasses
import os
import time
from pathlib import Path

import torch

from swiftlm.config import TrainConfig
from swiftlm.config.rules import Facts, pipeline
from swiftlm.distributed.launch import launched_by_torchrun
from swiftlm.models.attention import flash_attention_available
from swiftlm.train.autobatch import auto_batch_size


def run_facts(method_cls) -> Facts:
    """What the rules check a training config against besides its flags: the method, and the
    processes torchrun started (1 without torchrun)."""
    world_size = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1
    return Facts(world_size=world_size, method=method_cls)


def resolve_config(
    cfg: TrainConfig, method_cls, model_name: str, device: torch.device
) -> TrainConfig:
    """`cfg` with every unset value that is known before the model loads filled in.

    `--per_device_train_batch_size auto` stays as it is (see `resolve_auto_batch`). Assumes
    the rules hold (`dataset_given`, `resume_auto_needs_output_dir`, ...)."""
    data, train, output = cfg.data, cfg.train, cfg.output
    resume = "auto" if restarted_by_torchrun() else output.resume_from_checkpoint
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
        output=dataclasses.replace(
            output,
            output_dir=output.output_dir or default_run_dir(model_name),
            resume_from_checkpoint=resume,
        ),
    )


def default_learning_rate(train_type: str) -> float:
    """1e-5 for full fine-tuning, 1e-4 for adapters."""
    return 1e-5 if train_type == "full" else 1e-4


def default_run_dir(model_name: str) -> str:
    """output/<model name>-<timestamp>."""
    return f"output/{model_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def restarted_by_torchrun() -> bool:
    """A worker restarted by torchrun (--max_restarts) resumes from the newest checkpoint."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def default_padding_free(cfg: TrainConfig, device: torch.device, method_cls) -> bool:
    """Unset --padding_free: on where dropping padding is a pure gain.

    On CPUs every padding token costs as much as a real one, and per-sample attention is as
    fast as batched; on CUDA that holds with flash-attn's varlen kernel, while without it
    per-sample SDPA calls (one host sync per layer) can cost more than the padding saves.
    Packed rows are already full, pipeline stages need fixed shapes, and some methods' samples
    cannot share a row.
    """
    fixed_shapes = cfg.train.packing or pipeline(cfg.dist) or not method_cls.supports_packing
    return not fixed_shapes and (device.type == "cpu" or flash_attention_available(device))


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
