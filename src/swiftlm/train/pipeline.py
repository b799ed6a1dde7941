"""The steps shared by `swiftlm sft` and `swiftlm pt`: config -> model -> data -> loop -> final/."""

import dataclasses
import os
import time
from pathlib import Path

import torch

from swiftlm.config import TrainConfig, save_config
from swiftlm.data.cache import cache_key, data_cache_root, load_or_encode, sample_lengths
from swiftlm.data.encode import encode_chat_samples, encode_pretraining
from swiftlm.data.loading import load_samples, split_samples
from swiftlm.distributed.env import init_distributed, shutdown_distributed
from swiftlm.distributed.heartbeat import Heartbeat
from swiftlm.distributed.strategy import build_strategy
from swiftlm.errors import ConfigError
from swiftlm.losses.causal_lm import causal_lm_loss
from swiftlm.losses.fused_ce import fused_causal_lm_loss, install_fused_lm_head
from swiftlm.models.attention import flash_attention_available, training_attention
from swiftlm.models.loader import (
    load_model,
    load_tokenizer,
    pick_device,
    pick_dtype,
    resolve_model,
)
from swiftlm.models.quant import (
    bnb_config,
    describe_bnb,
    prepare_for_quantized_training,
    quantized_training_problems,
)
from swiftlm.monitor.metrics import format_summary
from swiftlm.monitor.mfu import flops_per_token, peak_flops
from swiftlm.train.autobatch import auto_batch_size
from swiftlm.train.batching import build_batch_plan, describe_plan
from swiftlm.train.loop import TrainingJob, run_training
from swiftlm.tuners.setup import apply_tuner, count_parameters

# `swiftlm sft` with neither --model nor --dataset: teach the packaged SmolLM2 a new name,
# mixed with ordinary Q&A so it keeps answering other questions.
BUILTIN_SFT_DATASETS = ["swiftlm/self-cognition", "swiftlm/general-qa"]


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


def resolve_defaults(cfg: TrainConfig, kind: str, model_name: str) -> TrainConfig:
    """Fill what depends on other options: learning rate, run directory, default data."""
    cfg = dataclasses.replace(cfg)
    if not cfg.data.dataset:
        if kind == "text" or cfg.model.model is not None:
            raise ConfigError(
                "--dataset is required (a .jsonl/.json/.csv/.parquet/.txt file or hub id)"
            )
        cfg.data = dataclasses.replace(cfg.data, dataset=list(BUILTIN_SFT_DATASETS))
    if cfg.train.learning_rate is None:
        lr = 1e-5 if cfg.tuner.train_type == "full" else 1e-4
        cfg.train = dataclasses.replace(cfg.train, learning_rate=lr)
    if cfg.output.output_dir is None:
        if cfg.output.resume_from_checkpoint == "auto":
            raise ConfigError("--resume_from_checkpoint auto needs the --output_dir of the run")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        cfg.output = dataclasses.replace(cfg.output, output_dir=f"output/{model_name}-{stamp}")
    return cfg


def load_splits(cfg: TrainConfig, kind: str, log) -> tuple[list[dict], list[dict]]:
    """Load and validate every row, then split off validation samples."""
    d = cfg.data
    placeholders = {"{{NAME}}": cfg.model.model_name, "{{AUTHOR}}": cfg.model.model_author}
    options = dict(skip_bad_rows=d.skip_bad_rows, seed=d.data_seed, system=d.system)
    train, report = load_samples(d.dataset, kind, placeholders=placeholders, **options)
    if report.skipped:
        log(report.summary())
    if not d.val_dataset:
        return split_samples(train, d.split_dataset_ratio, d.data_seed)
    val, _ = load_samples(d.val_dataset, kind, placeholders=placeholders, **options)
    return train, val


def encode_samples(cfg: TrainConfig, tokenizer, samples: list[dict], kind: str, log) -> list[dict]:
    """Token ids + labels: chunked text for `pt`, masked conversations for `sft`."""
    d = cfg.data
    if not samples:
        return []
    if kind == "text":
        return encode_pretraining(tokenizer, [s["text"] for s in samples], d.max_length)
    encoded, truncation = encode_chat_samples(
        tokenizer, samples, d.max_length, d.truncation_strategy, d.loss_scope
    )
    if truncation.summary():
        log(truncation.summary())
    return encoded


def compile_decoder_layers(model) -> int:
    """torch.compile each decoder layer in place: parameter names and state dicts stay as
    they are (checkpoints, adapters and FSDP wrapping see the usual modules), and the one
    compiled graph is reused by every layer of the same shape."""
    import shutil

    if not torch.cuda.is_available() and not (shutil.which("g++") or shutil.which("c++")):
        raise ConfigError(
            "--torch_compile on CPU needs a C++ compiler (g++) for torch.compile's inductor; "
            "install one (e.g. apt install g++) or drop --torch_compile"
        )
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ConfigError("--torch_compile: this model has no decoder `layers` to compile")
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def _data_cache_folder(cfg: TrainConfig, kind: str, tokenizer) -> Path:
    d = cfg.data
    options = {
        "kind": kind,
        "max_length": d.max_length,
        "truncation_strategy": d.truncation_strategy,
        "loss_scope": d.loss_scope,
        "system": d.system,
        "skip_bad_rows": d.skip_bad_rows,
        "data_seed": d.data_seed,
        "split_dataset_ratio": d.split_dataset_ratio,
        "placeholders": [cfg.model.model_name, cfg.model.model_author],
        "val_dataset": d.val_dataset,
    }
    key = cache_key([*d.dataset, *d.val_dataset], options, tokenizer)
    return data_cache_root() / key


def prepare_data(cfg: TrainConfig, kind: str, tokenizer, ctx, log) -> tuple:
    """Encoded (train, validation) samples, from the Arrow cache when an earlier run made them.

    Rank 0 encodes and writes the cache; the other ranks wait, then read it.
    """

    def encode() -> tuple[dict, list[str]]:
        lines: list[str] = []
        train, val = load_splits(cfg, kind, lines.append)
        return {
            "train": encode_samples(cfg, tokenizer, train, kind, lines.append),
            "val": encode_samples(cfg, tokenizer, val, kind, lines.append),
        }, lines

    if not cfg.data.load_from_cache_file:
        splits, lines = encode()
        for line in lines:
            log(line)
    else:
        folder = _data_cache_folder(cfg, kind, tokenizer)
        splits = load_or_encode(folder, encode, log) if ctx.is_main else None
        ctx.broadcast_object(None)  # the other ranks wait for rank 0's entry, then read it
        if not ctx.is_main:
            splits = load_or_encode(folder, encode, log)
    # Evaluation slices its samples: a plain list (validation sets are small).
    return splits["train"], list(splits["val"])


def prepare_model(
    cfg: TrainConfig, model_path: str, device: torch.device, compute_dtype: torch.dtype
):
    """Load the model and make the tuner's parameters trainable."""
    # Frozen base weights can live in the compute dtype; weights that train stay float32
    # (peft keeps adapters in float32) so small updates are not lost to rounding.
    full = cfg.tuner.train_type == "full"
    weight_dtype = torch.float32 if full or compute_dtype == torch.float16 else compute_dtype
    from transformers import AutoConfig

    packed = cfg.train.packing or cfg.train.padding_free
    config = AutoConfig.from_pretrained(model_path)
    attention = training_attention(cfg.model.attn_impl, device, packed, config, cfg.data.max_length)
    # QLoRA: the frozen Linear weights load quantized, their matmuls run in the compute dtype.
    quantization = bnb_config(cfg.quant, compute_dtype) if cfg.quant.quant_method else None
    model = load_model(model_path, weight_dtype, device, attention, quantization)
    if quantization is not None:
        model = prepare_for_quantized_training(model)
    model.config.use_cache = False
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = apply_tuner(model, cfg.tuner)
    if cfg.train.torch_compile:
        compile_decoder_layers(model)
    return model


def make_batch_plan(cfg: TrainConfig, lengths: list[int], dp_size: int):
    t = cfg.train
    return build_batch_plan(
        lengths,
        t.per_device_train_batch_size,
        dp_size,
        t.seed,
        pack_to=cfg.data.max_length if t.packing else 0,
        max_tokens=t.max_tokens_per_batch,
        padding_free=t.padding_free,
    )


def choose_loss_fn(cfg: TrainConfig, model, log):
    """The fused chunked LM-head loss when asked for and the model's head allows it."""
    if not cfg.train.fused_cross_entropy:
        return causal_lm_loss
    if install_fused_lm_head(model):
        return fused_causal_lm_loss
    log("--fused_cross_entropy: the output layer is not a plain Linear; using the plain loss")
    return causal_lm_loss


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


def resolve_padding_free(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """Unset --padding_free: on where dropping padding is a pure gain.

    On CPUs every padding token costs as much as a real one, and per-sample attention is as
    fast as batched; on CUDA that holds with flash-attn's varlen kernel, while without it
    per-sample SDPA calls (one host sync per layer) can cost more than the padding saves.
    Packed rows are already full, and pipeline stages need fixed shapes.
    """
    if cfg.train.padding_free is not None:
        return cfg
    fixed_shapes = cfg.train.packing or cfg.dist.pipeline_parallel_size > 1
    on = not fixed_shapes and (device.type == "cpu" or flash_attention_available(device))
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, padding_free=on))


def _silent(_: str) -> None:
    """Logging on ranks other than 0."""


def resume_after_restart(cfg: TrainConfig) -> TrainConfig:
    """A worker restarted by torchrun (--max_restarts) resumes from the newest checkpoint."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return cfg
    return dataclasses.replace(
        cfg, output=dataclasses.replace(cfg.output, resume_from_checkpoint="auto")
    )


def run_train_command(cfg: TrainConfig, kind: str, log=print) -> dict:
    """Run a training command top to bottom and return its summary."""
    from transformers import set_seed

    check_config(cfg)
    ctx = init_distributed(cfg.dist.dist_timeout)
    log = log if ctx.is_main else _silent
    resolved = resolve_model(cfg.model.model) if ctx.is_main else None
    resolved = ctx.broadcast_object(resolved)  # rank 0 converts a GGUF once; others reuse it
    cfg = resume_after_restart(resolve_defaults(cfg, kind, resolved.name))
    run_dir = Path(cfg.output.output_dir)
    device = pick_device(cfg.model.device, ctx.local_rank)
    compute_dtype = pick_dtype(cfg.model.torch_dtype, device)
    cfg = resolve_padding_free(cfg, device)
    strategy = build_strategy(cfg.dist, ctx, device, compute_dtype, cfg.train, cfg.data.max_length)
    log(
        f"model {resolved.requested} on {device} x {ctx.world_size} ({type(strategy).__name__}, "
        f"{str(compute_dtype).replace('torch.', '')} compute)"
    )
    tokenizer = load_tokenizer(resolved.path)
    train_data, val_data = prepare_data(cfg, kind, tokenizer, ctx, log)
    log(f"data: {len(train_data)} training samples, {len(val_data)} validation samples")
    set_seed(cfg.train.seed)  # the same initial weights on every rank
    model = prepare_model(cfg, resolved.path, device, compute_dtype)
    trainable, total = count_parameters(model)
    log(
        f"{cfg.tuner.train_type}: {trainable:,} trainable of {total:,} parameters "
        f"({100 * trainable / total:.2f}%)"
    )
    if cfg.quant.quant_method:
        log(f"QLoRA: frozen base in {describe_bnb(cfg.quant)}, adapters in float32")
    loss_fn = choose_loss_fn(cfg, model, log)
    if cfg.train.per_device_train_batch_size == 0:
        cfg = resolve_auto_batch(cfg, model, loss_fn, (device, compute_dtype), ctx, log)
    lengths = sample_lengths(train_data)
    mean_length = sum(lengths) / len(lengths)
    flops = flops_per_token(model, int(mean_length), cfg.train.gradient_checkpointing)
    peak = peak_flops(device, compute_dtype) * ctx.world_size
    if ctx.is_main:
        save_config(cfg, run_dir / "config.yaml")
    batch_plan = make_batch_plan(cfg, lengths, strategy.dp_size)
    log(describe_plan(batch_plan, cfg.data.max_length))
    job = TrainingJob(
        model=strategy.wrap(model),
        tokenizer=tokenizer,
        loss_fn=loss_fn,
        train_data=train_data,
        val_data=val_data,
        device=device,
        compute_dtype=compute_dtype,
        args=cfg.train,
        output=cfg.output,
        run_dir=run_dir,
        strategy=strategy,
        batch_plan=batch_plan,
        flops_per_token=flops,
        peak_flops=peak,
        heartbeat=Heartbeat(ctx, cfg.dist.heartbeat_timeout, run_dir) if ctx.distributed else None,
        log=log,
    )
    try:
        if job.heartbeat:
            job.heartbeat.start()
        summary = run_training(job)
        if job.heartbeat:
            job.heartbeat.beat(summary["steps"], "final save")
        strategy.save_final(job.model, tokenizer, run_dir / "final")
    finally:
        if job.heartbeat:
            job.heartbeat.stop()
        shutdown_distributed()
    summary["output"] = str(run_dir / "final")
    log(format_summary(summary))
    return summary
