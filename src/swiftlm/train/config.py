"""The config sections of the training loop (`TrainArguments`: epochs and steps, batches,
optimizer and schedule, precision, checkpoints, logging) and of a run's outputs
(`OutputArguments`: the run directory, resume, what is saved). Same conventions as
`config/sections.py`: field names are the flag names, each field's `help` is its `--help`
text, each section checks its own fields when built.
"""

from dataclasses import dataclass
from typing import Literal

from swiftlm.config.checks import above, at_least, check_fields, custom, within
from swiftlm.config.sections import doc
from swiftlm.errors import ConfigError

# ---- --optim: the optimizers (transformers' `TrainingArguments.optim` names where it has one)
# and the settings each takes through `--optim_args key=value,...`; checked when the section is
# built, before anything loads (`train.optim` builds them).
# name -> the --optim_args it takes and their defaults (the defaults transformers uses for the
# same name; Muon's are torch.optim.Muon's, with its learning rate matched to AdamW's).
OPTIM_SETTINGS: dict[str, dict[str, object]] = {
    "adamw_torch": {},
    "adamw_torch_fused": {},
    "adamw_8bit": {},
    "paged_adamw_8bit": {},
    "adafactor": {},
    "muon": {"momentum": 0.95, "nesterov": True, "ns_steps": 5},
    "schedule_free_adamw": {"weight_lr_power": 2.0, "r": 0.0},
    "galore_adamw": {"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"},
    "apollo_adamw": {
        "rank": 128,
        "proj": "random",
        "scale_type": "channel",
        "update_proj_gap": 200,
        "scale": 1.0,
        "proj_type": "std",
    },
}
OPTIM_NAMES = tuple(OPTIM_SETTINGS)
DEFAULT_OPTIM = "adamw_torch"

# Optimizers whose projections apply to full weight matrices' gradients: --train_type full.
LOW_RANK_PROJECTION = ("galore_adamw", "apollo_adamw")
# Optimizers whose update kernels work on DTensor parameters (FSDP2, tensor parallel): checked
# by stepping each on sharded parameters. bitsandbytes' kernels, Adafactor's factored moments
# and GaLore/APOLLO's projections mix DTensors with plain tensors and fail inside step().
DTENSOR_CAPABLE = ("adamw_torch", "adamw_torch_fused", "muon", "schedule_free_adamw")
# DeepSpeed flattens the parameters into 1-D partitions before the optimizer sees them, so only
# an elementwise optimizer gives the same update there.
DEEPSPEED_CAPABLE = ("adamw_torch", "adamw_torch_fused")


def parse_optim_args(optim: str, text: str | None) -> dict[str, object]:
    """`--optim_args` ("rank=64,update_proj_gap=50") over `optim`'s defaults, each value
    converted to its default's type. ConfigError naming the key and the accepted ones."""
    settings = dict(OPTIM_SETTINGS[optim])
    for item in (text or "").replace(" ", "").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or key not in settings:
            raise ConfigError(_unknown(optim, item, key if sep else None))
        settings[key] = _typed(optim, key, value, settings[key])
    return settings


def _unknown(optim: str, item: str, key: str | None) -> str:
    accepted = ", ".join(OPTIM_SETTINGS[optim]) or "none"
    what = f"`{item}` is not key=value" if key is None else f"`{key}` is not a setting of it"
    return f"--optim_args for --optim {optim}: {what}; it takes {accepted}"


def _typed(optim: str, key: str, value: str, default: object) -> object:
    try:
        if isinstance(default, bool):
            if value.lower() not in ("true", "false"):
                raise ValueError(value)
            return value.lower() == "true"
        return type(default)(value)
    except ValueError:
        raise ConfigError(
            f"--optim_args for --optim {optim}: {key}={value} must be a "
            f"{type(default).__name__} (default {default})"
        ) from None


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
    optim: Literal[OPTIM_NAMES] = doc(
        "The optimizer (transformers' names): adamw_torch, adamw_torch_fused, adamw_8bit and "
        "paged_adamw_8bit (bitsandbytes), adafactor, muon (torch.optim.Muon on the hidden "
        "weight matrices, AdamW on the rest), schedule_free_adamw (swiftlm[optimizers]; the "
        "schedule is constant, its warmup --warmup_ratio), galore_adamw and apollo_adamw "
        "(swiftlm[optimizers]; --train_type full). See docs/training.md#optimizers.",
        default=DEFAULT_OPTIM,
    )
    optim_args: str | None = doc(
        "Settings of --optim as key=value,... (transformers' format), e.g. "
        "'rank=64,update_proj_gap=50' for galore_adamw; each optimizer's keys and defaults "
        "are in docs/training.md#optimizers.",
        default=None,
    )
    optim_target_modules: list[str] | None = doc(
        "galore_adamw / apollo_adamw: the linear layers whose weight gradients are projected, "
        "as regexes matched against module names (the rest train with plain AdamW). Default: "
        "the attention and MLP layers (names containing attn or mlp).",
        default=None,
    )
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
        "as with --packing); GRPO: a micro-batch's completions in one row, each prompt "
        "computed once. Unset: on where it is faster (CPUs; CUDA with flash-attn), off "
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
    use_liger_kernel: bool = doc(
        "CUDA only: run RMSNorm, RoPE, SwiGLU and the fused LM-head loss as Liger's Triton "
        "kernels (pip install 'swiftlm[liger]').",
        default=False,
    )
    fp8_recipe: Literal["tensorwise", "rowwise"] | None = doc(
        "FP8 training of the decoder's linear layers (torchao float8, ms-swift's flag name): "
        "dynamic scales per tensor or per row. The LM head and layers whose dims are not "
        "multiples of 16 stay in high precision; without an FP8 GPU (sm89+) the float8 "
        "matmuls are emulated (numerics, not speed). Needs torchao (swiftlm[quant]).",
        default=None,
    )
    router_aux_loss_coef: float = doc(
        "Mixture-of-experts models: weight of the routers' load-balancing loss (transformers' "
        "definition) added to the training loss; 0 leaves it out. Router health is logged "
        "either way.",
        default=0.0,
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
            router_aux_loss_coef=at_least(0, note="0 leaves the load-balancing loss out"),
        )
        parse_optim_args(self.optim, self.optim_args)  # a bad key or value: ConfigError now


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
