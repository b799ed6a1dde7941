"""The data, model and batch plan of a training run, each prepared for the run's method."""

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from swiftlm.config import TrainConfig
from swiftlm.data.cache import (
    FILES_READ,
    cache_key,
    data_cache_root,
    file_fingerprints,
    load_or_encode_with_stats,
    load_or_stream_encode,
    sample_lengths,
)
from swiftlm.data.loading import load_samples, split_samples
from swiftlm.data.stream_encode import ChunkJob, DataOptions, encode_splits, select_splits
from swiftlm.errors import ConfigError
from swiftlm.methods.base import Method
from swiftlm.methods.vision import PACKABLE, VisionInputs
from swiftlm.models.attention import training_attention
from swiftlm.models.fp8 import apply_fp8_training
from swiftlm.models.liger import apply_liger_kernels
from swiftlm.models.loader import CAUSAL_LM, load_model, load_tokenizer
from swiftlm.models.quant import bnb_config, prepare_for_quantized_training
from swiftlm.models.vision import load_processor, vision_language_type
from swiftlm.monitor.data_health import (
    LayoutFacts,
    SplitFacts,
    count_labels,
    format_data_health,
    label_columns,
    summarize_data,
    write_data_health,
)
from swiftlm.train.batching import BatchPlan, FixedSizeEpoch, build_batch_plan, epoch_totals
from swiftlm.tuners.setup import apply_tuner


def build_method(cfg: TrainConfig, method_cls, model_path: str) -> tuple[Method, object, object]:
    """The run's method, its tokenizer, and what checkpoints save beside the weights (the
    tokenizer, or a vision-language model's whole processor).

    A vision-language model gives the method its processor (methods.vision.VisionInputs);
    a method that does not train on images refuses it, and packed batches are refused for
    the architectures whose image positions are not plain restarting positions."""
    vision_type = vision_language_type(model_path)
    if not vision_type:
        tokenizer = load_tokenizer(model_path)
        return method_cls(cfg, tokenizer), tokenizer, tokenizer
    if not method_cls.supports_images:
        raise ConfigError(
            f"{method_cls.name} does not train vision-language models ({vision_type}); "
            "use swiftlm sft or swiftlm rlhf --rlhf_type dpo, or a text-only --model"
        )
    flag = "--packing" if cfg.train.packing else "--padding_free"
    if (cfg.train.packing or cfg.train.padding_free) and not method_cls.packs_images:
        raise ConfigError(
            f"{flag}: {method_cls.name} on a vision-language model keeps one conversation per "
            "row (its image features are laid out per row); drop the flag"
        )
    if (cfg.train.packing or cfg.train.padding_free) and vision_type not in PACKABLE:
        raise ConfigError(
            f"{flag}: packed batches of {vision_type} models need per-sample image positions "
            "(Qwen2-VL's multimodal rotary positions, Idefics3's per-sample image grids), which "
            f"swiftlm builds only for {', '.join(PACKABLE)}; drop the flag (batches are padded "
            "per sample)"
        )
    processor = load_processor(model_path)
    vision = VisionInputs(processor, vision_type, cfg.data.max_pixels, cfg.data.dataset_num_proc)
    tokenizer = processor.tokenizer
    return method_cls(cfg, tokenizer, vision=vision), tokenizer, processor


def load_splits(cfg: TrainConfig, method: Method, log) -> tuple[list[dict], list[dict]]:
    """Read and validate every row with the method's schema, then split off validation."""
    d = cfg.data
    options = dict(skip_bad_rows=d.skip_bad_rows, seed=d.data_seed)
    train, report = load_samples(d.dataset, method.to_sample, **options)
    if report.skipped:
        log(report.summary())
    for line in report.notices(method.name):
        log(line)
    if not d.val_dataset:
        return split_samples(train, d.split_dataset_ratio, d.data_seed)
    val, val_report = load_samples(d.val_dataset, method.to_sample, **options)
    if val_report.skipped:
        log(f"--val_dataset: {val_report.summary()}")
    for line in val_report.notices(method.name):
        log(f"--val_dataset: {line}")
    return train, val


def _data_cache_folder(cfg: TrainConfig, method: Method, tokenizer) -> Path:
    d = cfg.data
    options = {
        **method.cache_options(),
        "columns": list(method.columns),
        "skip_bad_rows": d.skip_bad_rows,
        "data_seed": d.data_seed,
        "split_dataset_ratio": d.split_dataset_ratio,
        "val_dataset": d.val_dataset,
    }
    key = cache_key([*d.dataset, *d.val_dataset], options, tokenizer)
    return data_cache_root() / key


def prepare_data(cfg: TrainConfig, method: Method, tokenizer, ctx, log) -> tuple:
    """Encoded (train, validation) samples, from the Arrow cache when an earlier run made them,
    and their truncation counts ({"train": ..., "val": ...}; cached with the samples).

    Rank 0 encodes and writes the cache; the other ranks wait, then read it. A method that
    encodes chunk by chunk (`chunk_encoder`, text SFT) streams its rows into the cache entry
    (data.stream_encode), so no split is ever whole in memory.
    """
    sharded = method.sharded_data(cfg, ctx, log)  # pt: memory-mapped token shards
    if sharded is not None:
        return sharded
    encoder = method.chunk_encoder()
    if encoder is not None:
        return _prepare_streamed(cfg, method, encoder, tokenizer, ctx, log)

    def encode() -> tuple[dict, list[str], dict]:
        lines: list[str] = []
        splits, truncation, files = {}, {}, []
        for name, samples in zip(
            ("train", "val"), load_splits(cfg, method, lines.append), strict=True
        ):
            result = method.encode(samples) if samples else None
            splits[name] = result.samples if result else []
            lines += result.log if result else []
            truncation[name] = getattr(result, "truncation", {}) if result else {}
            files += getattr(result, "files_read", []) if result else []
        return splits, lines, {"truncation": truncation, FILES_READ: file_fingerprints(files)}

    if not cfg.data.load_from_cache_file:
        splits, lines, stats = encode()
        for line in lines:
            log(line)
    else:
        folder = _data_cache_folder(cfg, method, tokenizer)
        cached = dict(columns=method.columns, length=method.length)
        if ctx.is_main:
            splits, stats = load_or_encode_with_stats(folder, encode, log, **cached)
        ctx.broadcast_object(None)  # the other ranks wait for rank 0's entry, then read it
        if not ctx.is_main:
            splits, stats = load_or_encode_with_stats(folder, encode, log, **cached)
    # Evaluation slices its samples: a plain list (validation sets are small).
    return splits["train"], list(splits["val"]), stats.get("truncation", {})


def _prepare_streamed(cfg: TrainConfig, method: Method, encoder, tokenizer, ctx, log) -> tuple:
    """prepare_data for a method with a chunk encoder: the same samples, written chunk by
    chunk (in --dataset_num_proc processes) into the cache entry, which is then read
    memory-mapped; with --load_from_cache_file false the entry is written and removed."""
    d = cfg.data
    options = DataOptions(
        list(d.dataset), list(d.val_dataset), d.skip_bad_rows, d.data_seed, d.split_dataset_ratio
    )
    job = ChunkJob(encoder, tuple(method.columns), method.length, label_columns(method.columns))

    def encode_into(folder: Path) -> tuple[list[str], list[str], dict]:
        lines: list[str] = []
        started = time.perf_counter()  # the throughput counts the validating pass too
        selections = select_splits(options, method.to_sample, method.name, lines.append)
        names, encoded_lines, stats = encode_splits(
            selections, folder, method.to_sample, job, d.dataset_num_proc, started=started
        )
        return names, lines + encoded_lines, stats

    folder = _data_cache_folder(cfg, method, tokenizer)
    write = dict(columns=method.columns, keep=d.load_from_cache_file)
    if ctx.is_main or not d.load_from_cache_file:
        splits, stats = load_or_stream_encode(folder, encode_into, log, **write)
    if d.load_from_cache_file:
        ctx.broadcast_object(None)  # the other ranks wait for rank 0's entry, then read it
        if not ctx.is_main:
            splits, stats = load_or_stream_encode(folder, encode_into, log, **write)
    # The label counts made while encoding spare the data-health summary a pass over tokens.
    splits["train"].label_counts = tuple(stats.get("labels", {}).get("train", ())) or None
    return splits["train"], list(splits["val"]), stats.get("truncation", {})


def prepare_model(
    cfg: TrainConfig,
    model_path: str,
    device: torch.device,
    compute_dtype: torch.dtype,
    kind: str = CAUSAL_LM,
    pad_token_id: int | None = None,
    log=print,
):
    """Load the model as `kind` (the method's `model_kind`: a causal LM, or a reward model
    that needs the tokenizer's `pad_token_id`) and make the tuner's parameters trainable
    (for a vision-language model, under the freeze flags).
    Activation checkpointing and compilation are parallelisms, applied in order by the
    strategy's `wrap`."""
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
    model = load_model(
        model_path,
        weight_dtype,
        device,
        attention,
        quantization,
        kind,
        pad_token_id,
        experts_impl=cfg.model.experts_impl,
    )
    if quantization is not None:
        model = prepare_for_quantized_training(model)
    model.config.use_cache = False
    if cfg.train.fp8_recipe:
        log(apply_fp8_training(model, cfg.train.fp8_recipe, device))
    if cfg.train.use_liger_kernel:
        apply_liger_kernels(model, device)
    model = apply_tuner(model, cfg.tuner, kind, vision_language_type(model_path) or "")
    return model


@dataclass(frozen=True)
class StreamPlan(BatchPlan):
    """The plan of --streaming true: chunks in stream order, never shuffled (the stream
    serves them only in order: data.streaming), one epoch of --max_steps steps."""

    def _plan_epoch(self, epoch: int) -> FixedSizeEpoch:
        return FixedSizeEpoch(np.arange(len(self.lengths)), self.batch_size, self.dp_size)


def make_batch_plan(cfg: TrainConfig, lengths: list[int], dp_size: int, per_sample: int = 1):
    """`per_sample`: rows a sample becomes (GRPO: its completions; the batch size counts them)."""
    t = cfg.train
    if cfg.data.streaming:  # `lengths`: the stream's ConstantLengths, kept lazy
        return StreamPlan(lengths, t.per_device_train_batch_size, dp_size, t.seed)
    return build_batch_plan(
        lengths,
        t.per_device_train_batch_size // per_sample,
        dp_size,
        t.seed,
        pack_to=cfg.data.max_length if t.packing else 0,
        max_tokens=t.max_tokens_per_batch,
        padding_free=t.padding_free,
    )


def _layout_facts(plan: BatchPlan, pack_to: int) -> LayoutFacts:
    """The first epoch's micro-batches as row lengths (later epochs differ only in order, or
    by a micro-batch or two with a token budget)."""
    kind = [
        name
        for name, on in (
            ("packed", plan.packs is not None),
            ("padding-free", plan.padding_free),
            ("token budget", plan.max_tokens > 0),
        )
        if on
    ]
    totals = epoch_totals(plan)
    capacity = pack_to if plan.packs is not None else 0
    return LayoutFacts(
        " + ".join(kind) or "fixed size",
        totals.micro_batches,
        totals.rows,
        totals.real_tokens,
        totals.held_tokens,
        capacity,
    )


def report_data_health(
    cfg: TrainConfig, method: Method, data: tuple, plan: BatchPlan, run_dir: Path, ctx, log
) -> None:
    """Log the data-health summary and keep it as <run>/data_health.json (rank 0 only).

    `data`: (train samples, validation samples, truncation counts per split), as
    prepare_data returns them.
    """
    if not ctx.is_main:
        return
    train, val, truncation = data

    def facts(samples, lengths, name) -> SplitFacts:
        # (label tokens, tokens, samples) counted while encoding, else counted now
        labels = getattr(samples, "label_counts", None) or count_labels(samples, method.columns)
        return SplitFacts(lengths, labels, truncation.get(name, {}))

    val_lengths = sample_lengths(val, method.length) if len(val) else []
    summary = summarize_data(
        facts(train, plan.lengths, "train"),
        facts(val, val_lengths, "val") if len(val) else None,
        _layout_facts(plan, cfg.data.max_length),
    )
    log(format_data_health(summary))
    write_data_health(summary, run_dir)
