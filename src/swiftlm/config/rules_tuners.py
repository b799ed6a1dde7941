"""Rules of the tuners (see rules.py): which flags each --train_type takes, and the engines the
peft tuners beyond LoRA/DoRA, PiSSA/OLoRA and LISA are refused under, by name."""

from swiftlm.config.checks import Rule
from swiftlm.tuners.config import PEFT_TUNERS

LORA = ("lora", "dora")


def _engine(d) -> str | None:
    """The engine besides one process and DDP that the flags ask for, by name."""
    engines = (
        (d.deepspeed is not None or d.strategy == "deepspeed", "--deepspeed"),
        (d.fsdp is not None or d.strategy == "fsdp2", "FSDP2 (--fsdp)"),
        (d.tensor_parallel_size > 1 or d.strategy == "tp", "--tensor_parallel_size"),
        (d.pipeline_parallel_size > 1 or d.strategy == "pp", "--pipeline_parallel_size"),
        (d.expert_parallel_size > 1, "--expert_parallel_size"),
    )
    return next((name for asked, name in engines if asked), None)


def _peft_tuner(c) -> bool:
    return c.tuner.train_type in PEFT_TUNERS


def _mutating_init(c) -> bool:
    return c.tuner.init_weights.startswith(("pissa", "olora"))


TUNER_RULES = (
    Rule(
        "adalora_needs_its_allocator",
        lambda c, f: c.tuner.train_type == "adalora",
        "--train_type adalora: AdaLoRA's rank allocator must run after every optimizer step "
        "(peft's update_and_allocate, before the gradients are zeroed), its importance "
        "statistics must be checkpointed for an exact resume, and its orthogonality penalty "
        "joins the loss; swiftlm's loop does none of these yet: use --train_type lora",
    ),
    Rule(
        "peft_tuner_engines",
        lambda c, f: _peft_tuner(c) and _engine(c.dist) is not None,
        lambda c, f: (
            f"--train_type {c.tuner.train_type} with {_engine(c.dist)}: swiftlm shards, splits "
            "and checkpoints only LoRA/DoRA layers under that engine; train "
            f"{c.tuner.train_type} in one process or with DDP (--nproc_per_node), or use "
            "--train_type lora"
        ),
    ),
    Rule(
        "peft_tuner_quantized",
        lambda c, f: _peft_tuner(c) and c.quant.quant_method is not None,
        "--train_type {train_type} with --quant_method {quant_method}: swiftlm trains "
        "quantized bases with LoRA/DoRA adapters only (QLoRA); use --train_type lora or dora",
    ),
    Rule(
        "lorap_needs_lora",
        lambda c, f: c.tuner.lorap_lr_ratio is not None and c.tuner.train_type not in LORA,
        "--lorap_lr_ratio {lorap_lr_ratio} sets the learning rate of LoRA's B matrices; "
        "--train_type {train_type} has none: use --train_type lora or dora, or drop it",
    ),
    Rule(
        "init_weights_of_lora",
        lambda c, f: (
            c.tuner.train_type not in LORA and c.tuner.init_weights not in ("true", "false")
        ),
        "--init_weights {init_weights} initialises LoRA; --train_type {train_type} takes "
        "true or false (its own default or peft's identity-free start)",
    ),
    Rule(
        "loftq_needs_cuda",
        lambda c, f: c.tuner.init_weights == "loftq",
        "--init_weights loftq: peft's LoftQ quantizes the base with bitsandbytes' CUDA kernels "
        "(it fails without a GPU) and must then load that quantized base for training, which "
        "swiftlm does not do; use --init_weights pissa (or pissa_niter_4), or QLoRA "
        "(--quant_method bnb --quant_bits 4)",
    ),
    Rule(
        "pissa_not_with_dora",
        lambda c, f: _mutating_init(c) and c.tuner.train_type == "dora",
        "--init_weights {init_weights} with --train_type dora: DoRA normalizes W_res + BA, so "
        "the trained adapter has no plain-LoRA form of the original model to save; use "
        "--train_type lora",
    ),
    Rule(
        "pissa_not_quantized",
        lambda c, f: _mutating_init(c) and c.quant.quant_method is not None,
        "--init_weights {init_weights} with --quant_method {quant_method}: quantizing the "
        "residual weights breaks W = W_res + B0 A0, so final/ would not equal the trained "
        "model; drop one of them",
    ),
    Rule(
        "pissa_engines",
        lambda c, f: _mutating_init(c) and _engine(c.dist) is not None,
        lambda c, f: (
            f"--init_weights {c.tuner.init_weights} with {_engine(c.dist)}: converting final/ "
            "to a plain LoRA needs the initial adapter, which swiftlm keeps from unsharded "
            "weights only; train in one process or with DDP, or use --init_weights true"
        ),
    ),
    Rule(
        "lisa_needs_full",
        lambda c, f: c.tuner.lisa_activated_layers > 0 and c.tuner.train_type != "full",
        "--lisa_activated_layers {lisa_activated_layers} samples layers of a full fine-tune; "
        "use --train_type full, or drop it",
    ),
    Rule(
        "lisa_one_process",
        lambda c, f: c.tuner.lisa_activated_layers > 0 and f.world_size > 1,
        "--lisa_activated_layers with {world_size} processes: DDP and the sharding engines "
        "fix the parameters they synchronize when they wrap the model, and LISA changes them "
        "every --lisa_step_interval steps; train LISA in one process (--nproc_per_node 1)",
    ),
    Rule(
        "lisa_not_with_freeze_parameters",
        lambda c, f: c.tuner.lisa_activated_layers > 0 and bool(c.tuner.freeze_parameters),
        "--lisa_activated_layers with --freeze_parameters: LISA decides which decoder layers "
        "train at each step; drop --freeze_parameters",
    ),
)
