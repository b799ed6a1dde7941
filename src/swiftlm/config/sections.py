"""Typed config sections. Each field's `help` is the documentation shown by `--help`.

Field names are the flag names (flat, ms-swift style): a field `learning_rate` is the flag
`--learning_rate`. Names are unique across all sections so a flat YAML file or flat flags
map onto sections without ambiguity.

Each section checks its own fields, one at a time, in `__post_init__` (`checks.py`), so a bad
value fails as soon as the config is built: from flags, a YAML file or a saved config.yaml.
Rules between flags live in `rules.py`.
"""

from dataclasses import dataclass, field
from typing import Literal

from swiftlm.config.checks import above, at_least, check_fields, custom, within

# `--per_device_train_batch_size auto` is stored as this value until the model has loaded.
AUTO_BATCH_SIZE = 0
# `--report_to` values: the loggers swiftlm writes besides metrics.jsonl.
LOGGERS = ("tensorboard", "wandb", "swanlab")
LOGGER_CHOICES = (
    "the loggers are tensorboard, wandb and swanlab (any of them), or none alone for none"
)


def _json_object(text: str | None) -> bool:
    import json

    try:
        return text is None or isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _known_loggers(names: list[str]) -> bool:
    return names == ["none"] or all(name in LOGGERS for name in names)


def doc(text: str, choices_from=None, **kwargs):
    """A dataclass field whose `help` documents the flag. `choices_from`: a function giving
    the flag's choices when a parser or form is built (a registry that plugins add to),
    for a `str` field whose choices are not fixed in its type (see `flag_type`)."""
    metadata = {"help": text, **({"choices_from": choices_from} if choices_from else {})}
    return field(metadata=metadata, **kwargs)


def flag_type(f) -> object:
    """A section field's type as its flag takes it: `Literal[choices]` for a field whose
    choices come from a registry (`doc(choices_from=...)`), read now; else the field's own."""
    choices_from = f.metadata.get("choices_from")
    return Literal[tuple(choices_from())] if choices_from else f.type


@dataclass
class ModelArguments:
    model: str | None = doc(
        "Model to load: a local Hugging Face folder, a hub id, or a .gguf file (converted once "
        "into a cached Hugging Face folder). Default: the packaged SmolLM2-135M-Instruct.",
        default=None,
    )
    torch_dtype: Literal["auto", "bfloat16", "float16", "float32"] = doc(
        "Compute dtype. auto = bfloat16 on CUDA with bf16 or a CPU with native bf16 matmul, "
        "else float32. Trainable weights stay float32; compute runs under autocast.",
        default="auto",
    )
    device: Literal["auto", "cpu", "cuda", "mps"] = doc(
        "Device. auto picks cuda > mps > cpu.", default="auto"
    )
    attn_impl: Literal["sdpa", "eager"] = doc("Attention implementation.", default="sdpa")
    model_name: str = doc(
        "Name the built-in self-cognition data teaches the model (fills {{NAME}}).",
        default="Swifty",
    )
    model_author: str = doc(
        "Maker the built-in self-cognition data teaches the model (fills {{AUTHOR}}).",
        default="the swiftlm team",
    )


@dataclass
class DataArguments:
    dataset: list[str] = doc(
        "Training data: local .jsonl/.json/.csv/.parquet/.txt files or hub ids; several are "
        "mixed. `path#N` takes N samples. Default: the built-in self-cognition mix.",
        default_factory=list,
    )
    val_dataset: list[str] = doc("Validation data, same forms as --dataset.", default_factory=list)
    split_dataset_ratio: float = doc(
        "Fraction of --dataset held out for validation when --val_dataset is not given.",
        default=0.0,
    )
    max_length: int = doc("Longest sample in tokens (prompt + answer).", default=2048)
    truncation_strategy: Literal["delete", "left", "right"] = doc(
        "Over-long samples: delete them, or cut tokens from the left or the right.",
        default="delete",
    )
    system: str | None = doc("System prompt added to conversations that have none.", default=None)
    loss_scope: Literal["assistant", "last_turn", "all"] = doc(
        "Tokens that carry loss: every assistant turn, the last assistant turn, or all tokens.",
        default="assistant",
    )
    skip_bad_rows: bool = doc(
        "Skip invalid rows (and print counts by reason) instead of stopping before training.",
        default=False,
    )
    data_seed: int = doc("Seed for sampling, mixing and splitting datasets.", default=42)
    load_from_cache_file: bool = doc(
        "Reuse the tokenized dataset cached (Arrow) by an earlier run with the same files, "
        "tokenizer and data options; false re-tokenizes.",
        default=True,
    )
    max_pixels: int = doc(
        "Vision-language models: images with more pixels than this are scaled down (aspect "
        "kept) before the processor; 0 keeps the processor's own limits.",
        default=0,
    )
    dataset_num_proc: int = doc(
        "SFT: processes that tokenize conversations (text models) or decode and preprocess "
        "images (vision-language models) on a cache miss (spawned, each with the tokenizer "
        "or processor); pt: processes that tokenize local .jsonl/.txt files into token shards "
        "(spawned); 1 encodes in the main process.",
        default=1,
    )
    streaming: bool = doc(
        "pt: read and tokenize local .jsonl/.txt data while training, in file order (see "
        "--shuffle_buffer_size), never cached; a resume seeks to the saved byte offset. Needs "
        "--max_steps.",
        default=False,
    )
    shuffle_buffer_size: int = doc(
        "pt --streaming true: shuffle the chunks within consecutive windows of this many "
        "(seeded by --data_seed; a resume re-reads at most one window); 0 keeps file order.",
        default=0,
    )

    def __post_init__(self):
        check_fields(
            self,
            split_dataset_ratio=within(0, 1, note="the fraction held out", open_high=True),
            max_length=at_least(2),
            max_pixels=at_least(0),
            dataset_num_proc=at_least(1),
            shuffle_buffer_size=at_least(0),
        )


@dataclass
class TunerArguments:
    train_type: Literal["lora", "dora", "full"] = doc(
        "What to train: LoRA adapters, DoRA adapters, or all weights.", default="lora"
    )
    lora_rank: int = doc("LoRA rank r.", default=8)
    lora_alpha: int = doc(
        "LoRA alpha (scale = alpha / r, or alpha / sqrt(r) with rsLoRA).", default=32
    )
    lora_dropout: float = doc("Dropout on the LoRA input.", default=0.05)
    target_modules: list[str] = doc(
        "Modules that get adapters: `all-linear` or module names such as q_proj v_proj.",
        default_factory=lambda: ["all-linear"],
    )
    use_rslora: bool = doc("Rank-stabilized LoRA scaling (alpha / sqrt(r)).", default=False)
    modules_to_save: list[str] = doc(
        "Modules trained in full next to the adapters (e.g. lm_head).", default_factory=list
    )
    freeze_vit: bool = doc(
        "Vision-language models: keep the vision encoder frozen (no adapters, no updates).",
        default=True,
    )
    freeze_aligner: bool = doc(
        "Vision-language models: keep the aligner (projector/merger between the vision encoder "
        "and the language model) frozen; otherwise it trains in full, also with LoRA.",
        default=True,
    )
    freeze_parameters: list[str] = doc(
        "--train_type full: parameter name prefixes to keep frozen (e.g. model.embed_tokens); "
        "each must match at least one parameter.",
        default_factory=list,
    )
    freeze_llm: bool = doc(
        "Vision-language models: keep the language model frozen (e.g. to train the aligner "
        "first, as LLaVA does).",
        default=False,
    )

    def __post_init__(self):
        check_fields(
            self,
            lora_rank=at_least(1),
            lora_alpha=above(0),
            lora_dropout=within(0, 1, open_high=True),
        )


@dataclass
class TrainArguments:
    num_train_epochs: float = doc("Passes over the training data.", default=3.0)
    max_steps: int = doc("Optimizer steps; overrides --num_train_epochs when > 0.", default=-1)
    per_device_train_batch_size: int = doc(
        "Samples per micro-batch (packed rows with --packing). `auto` (or 0) picks the largest "
        "that fits: probed on GPUs, estimated from free memory on CPUs.",
        default=1,
    )
    per_device_eval_batch_size: int = doc("Samples per evaluation batch.", default=1)
    gradient_accumulation_steps: int = doc(
        "Micro-batches per optimizer step (an elastic job, --nnodes MIN:MAX: at MAX nodes; on "
        "fewer it grows to keep the global batch).",
        default=1,
    )
    learning_rate: float | None = doc(
        "Peak learning rate. Default: 1e-4 for LoRA/DoRA, 1e-5 for full.", default=None
    )
    lr_scheduler_type: Literal["cosine", "linear", "constant"] = doc(
        "Learning-rate decay after warmup.", default="cosine"
    )
    warmup_ratio: float = doc("Fraction of steps with linear warmup.", default=0.0)
    weight_decay: float = doc("AdamW weight decay (not applied to biases and norms).", default=0.1)
    adam_beta1: float = doc("AdamW beta1.", default=0.9)
    adam_beta2: float = doc("AdamW beta2.", default=0.95)
    adam_epsilon: float = doc("AdamW epsilon.", default=1e-8)
    max_grad_norm: float = doc("Clip the gradient norm to this (0 disables).", default=1.0)
    gradient_checkpointing: bool = doc(
        "Recompute activations in the backward pass to save memory.", default=False
    )
    packing: bool = doc(
        "Bin-pack samples into rows of up to --max_length tokens (best-fit decreasing). "
        "Attention and positions restart per sample, so losses equal unpacked training.",
        default=False,
    )
    padding_free: bool | None = doc(
        "Concatenate each micro-batch into one row without padding (samples stay separate, "
        "as with --packing). Unset: on where it is faster (CPUs; CUDA with flash-attn), off "
        "with --packing or --pipeline_parallel_size.",
        default=None,
    )
    max_tokens_per_batch: int = doc(
        "Token budget per micro-batch: micro-batches are filled from length-sorted buckets up "
        "to this many tokens (padding included unless --padding_free). 0: fixed "
        "--per_device_train_batch_size.",
        default=0,
    )
    fused_cross_entropy: bool = doc(
        "Compute the LM head and the loss in chunks, only at label positions, so the "
        "[tokens, vocab] logits are never held in memory.",
        default=True,
    )
    torch_compile: bool = doc(
        "Compile each decoder layer with torch.compile (slow first steps, faster after).",
        default=False,
    )
    seed: int = doc("Seed for weights init, dropout and data order.", default=42)
    nonfinite_loss: Literal["error", "skip"] = doc(
        "A NaN/inf loss either stops the run with an error, or skips that optimizer step.",
        default="error",
    )

    def __post_init__(self):
        check_fields(
            self,
            per_device_train_batch_size=custom(
                lambda v: v >= AUTO_BATCH_SIZE, "--{flag} {value} must be at least 1, or auto"
            ),
            per_device_eval_batch_size=at_least(1),
            gradient_accumulation_steps=at_least(1),
            learning_rate=above(0, note="or unset: the default of the train type"),
            warmup_ratio=within(0, 1),
            weight_decay=at_least(0),
            adam_beta1=within(0, 1, open_high=True),
            adam_beta2=within(0, 1, open_high=True),
            adam_epsilon=at_least(0),
            max_grad_norm=at_least(0, note="0 disables clipping"),
            max_tokens_per_batch=at_least(0, note="0: a fixed --per_device_train_batch_size"),
        )


@dataclass
class OutputArguments:
    output_dir: str | None = doc(
        "Run directory. Default: output/<model name>-<timestamp>.", default=None
    )
    overwrite_output_dir: bool = doc(
        "Delete the earlier swiftlm run in --output_dir, then start this one there.", default=False
    )
    add_version: bool = doc(
        "Write the run into a new <output_dir>/v<N>-<timestamp> (ms-swift's naming).", default=False
    )
    logging_steps: int = doc("Log metrics every N optimizer steps (and always step 1).", default=5)
    save_steps: int = doc(
        "Save a checkpoint every N optimizer steps (and at the end).", default=500
    )
    save_total_limit: int | None = doc(
        "Keep at most N checkpoints (the newest complete one is never deleted).", default=None
    )
    eval_steps: int | None = doc(
        "Evaluate every N optimizer steps (and at the end). Default: --save_steps.", default=None
    )
    resume_from_checkpoint: str | None = doc(
        "Resume from a checkpoint folder, a mirrored one's URL (<mirror>/checkpoints/step-N), "
        "or `auto` for the newest complete one across the run directory, the local tier "
        "(--local_save_steps) and the mirror (--checkpoint_mirror).",
        default=None,
    )
    local_save_steps: int | None = doc(
        "Also save a checkpoint every N steps to fast local storage (--local_save_dir); a step "
        "due for --save_steps as well goes to the run directory only.",
        default=None,
    )
    local_save_dir: str | None = doc(
        "Folder of the local tier. Default: /dev/shm/swiftlm/<run name>-<hash of its path>. "
        "Checkpoints there are per machine: one node only.",
        default=None,
    )
    local_save_total_limit: int = doc("Keep at most N checkpoints in the local tier.", default=2)
    checkpoint_mirror: str | None = doc(
        "Copy every complete checkpoint of the run directory, in the background, to this "
        "fsspec URL (s3://bucket/prefix, gs://..., file:///path; the cloud extra), COMPLETE "
        "last; it keeps --save_total_limit too. A copy that fails is a warning and is retried "
        "after the next checkpoint (training goes on); a URL that cannot be written at startup "
        "is an error. Credentials and endpoint: the store's environment variables "
        "(AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...) or --checkpoint_mirror_options.",
        default=None,
    )
    checkpoint_mirror_options: str | None = doc(
        "fsspec storage options of --checkpoint_mirror as a JSON object, e.g. "
        '\'{"endpoint_url": "http://127.0.0.1:9000"}\' for an S3-compatible store.',
        default=None,
    )
    report_to: list[str] = doc(
        "Loggers besides metrics.jsonl: tensorboard, wandb, swanlab (the wandb/swanlab extras; "
        "WANDB_MODE=offline / SWANLAB_MODE=offline keep them local), several at once, or none.",
        default_factory=lambda: ["tensorboard"],
    )

    def __post_init__(self):
        check_fields(
            self,
            logging_steps=at_least(1),
            save_steps=at_least(1),
            eval_steps=at_least(1, note="or unset: every --save_steps"),
            report_to=custom(_known_loggers, "--{flag} {value}: " + LOGGER_CHOICES),
            local_save_steps=at_least(1, note="or unset: no local tier"),
            local_save_total_limit=at_least(1),
            checkpoint_mirror=custom(
                lambda url: url is None or "://" in url,
                "--{flag} {value}: give a URL with its scheme (s3://bucket/prefix, gs://..., "
                "file:///path)",
            ),
            checkpoint_mirror_options=custom(
                _json_object, "--{flag} {value}: give the storage options as a JSON object"
            ),
        )


@dataclass
class OverwriteArguments:
    """The overwrite flag of the commands that write one file or folder (infer, eval, export,
    report, plan); training's own, which deletes an earlier run, is in OutputArguments."""

    overwrite_output_dir: bool = doc(
        "Replace what the output flag (--result_path, --eval_output_dir, --output_dir, "
        "--output, --output_json) names when it exists already. Without it an existing file "
        "is refused. An input of the run (dataset, model, run directory) is refused always.",
        default=False,
    )


@dataclass
class QuantArguments:
    quant_method: Literal["bnb", "int8", "int4", "gptq", "awq"] | None = doc(
        "Weight quantization. Training (sft/pt): bnb loads the frozen base in 4 or 8 bits "
        "(QLoRA). Export: bnb (bitsandbytes 4/8-bit), int8 (torchao int8 weight-only), "
        "int4 (torchao int4 weight-only; on CPU stored one byte per weight), gptq or awq "
        "(GPT-QModel, calibrated on --dataset; CPU or CUDA).",
        default=None,
    )
    quant_bits: int | None = doc(
        "Bits per weight for --quant_method: 4 or 8 (bnb and gptq, default 4); int8 implies 8, "
        "int4 and awq imply 4.",
        default=None,
    )
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = doc(
        "4-bit bitsandbytes data type: NF4 (QLoRA's) or FP4.", default="nf4"
    )
    bnb_4bit_use_double_quant: bool = doc(
        "Quantize the 4-bit quantization constants too (QLoRA's double quantization).",
        default=True,
    )
    group_size: int = doc(
        "Weights sharing one scale in int4/gptq/awq quantization (torchao int4 and AWQ: 32, "
        "64 or 128; int4 falls back to the largest of these that divides every layer's width, "
        "e.g. 64 for SmolLM2's 576).",
        default=128,
    )
    quant_n_samples: int = doc(
        "Calibration samples taken from --dataset for gptq/awq.", default=128
    )

    def __post_init__(self):
        check_fields(
            self,
            group_size=custom(
                lambda v: v == -1 or v >= 1,
                "--{flag} {value}: pass a positive size (e.g. 128) or -1 (per channel)",
            ),
            quant_n_samples=custom(lambda v: v >= 1, "--{flag} must be at least 1, not {value}"),
        )
