"""Every rule between flags (two flags or more, or a flag and a fact of the run), one table
entry each; checks of one field live on their section. A command calls `check(cfg, facts)`
once, before anything loads: the first broken rule in table order is raised as a ConfigError
naming the flags and the fix (later rules may assume that earlier ones hold).
"""

from typing import Any

from swiftlm.config.checks import Facts, Rule
from swiftlm.config.commands import EvalConfig, ExportConfig, InferConfig, RLHFConfig, TrainConfig
from swiftlm.config.rules_eval import EVAL_RULES, TRAIN_EVAL_RULES
from swiftlm.config.rules_export import (
    BNB_BITS_RULE,
    CKPT_DIR_OR_ADAPTERS_RULE,
    EXPORT_RULES,
)
from swiftlm.config.rules_optim import OPTIM_RULES
from swiftlm.config.rules_run_dir import RUN_DIR_RULES
from swiftlm.config.rules_streaming import STREAMING_RULES
from swiftlm.config.rules_tuners import TUNER_RULES
from swiftlm.distributed.config import DistArguments, node_range
from swiftlm.errors import ConfigError
from swiftlm.train.config import AUTO_BATCH_SIZE


def failures(cfg: Any, facts: Facts | None = None) -> list[tuple[str, str]]:
    """(rule name, message) of every rule of `cfg`'s command that the flags break, in order.
    `facts` default to the world the flags ask for (--nproc_per_node x --nnodes), no method."""
    dist = getattr(cfg, "dist", None)
    most = node_range(dist.nnodes)[1] if dist else 1
    facts = facts or Facts(world_size=dist.nproc_per_node * most if dist else 1)
    rules = next(RULES[cls] for cls in type(cfg).__mro__ if cls in RULES)  # rlhf: training's
    broken = ((rule.name, rule.failure(cfg, facts)) for rule in rules)
    return [(name, message) for name, message in broken if message]


def check(cfg: Any, facts: Facts | None = None) -> None:
    """Raise a ConfigError with the message of the first rule that `cfg` breaks."""
    broken = failures(cfg, facts)
    if broken:
        raise ConfigError(broken[0][1])


# ---- training: checkpoint tiers (checkpoint/tiers.py) ---------------------------------------
TIER_RULES = (
    Rule(
        "local_save_dir_needs_steps",
        lambda c, f: c.output.local_save_dir is not None and not c.output.local_save_steps,
        "--local_save_dir {local_save_dir} is only used with --local_save_steps N (how "
        "often to save there); add it or drop --local_save_dir",
    ),
    Rule(
        "local_tier_saves_between",
        lambda c, f: (
            bool(c.output.local_save_steps) and c.output.local_save_steps % c.output.save_steps == 0
        ),
        "--local_save_steps {local_save_steps} is a multiple of --save_steps {save_steps}: "
        "every such step is saved to the run directory, so the local tier would stay empty; "
        "give a smaller --local_save_steps (e.g. {save_steps} / 5)",
    ),
    Rule(
        "local_tier_one_node",
        lambda c, f: bool(c.output.local_save_steps) and node_range(c.dist.nnodes)[1] > 1,
        "--local_save_steps is available on one node only (each node's local storage would "
        "hold part of a checkpoint); drop it, or use --save_steps to shared storage",
    ),
    Rule(
        "mirror_options_need_mirror",
        lambda c, f: (
            c.output.checkpoint_mirror_options is not None
            and not c.output.checkpoint_mirror
            and "://" not in (c.output.resume_from_checkpoint or "")
        ),
        "--checkpoint_mirror_options is only used with --checkpoint_mirror URL (or a "
        "--resume_from_checkpoint URL); add it or drop the options",
    ),
)

# ---- training: data, steps, the method, the run directory -----------------------------------

TRAIN_RULES = (
    Rule(
        "steps_or_epochs",
        lambda c, f: c.train.max_steps <= 0 and c.train.num_train_epochs <= 0,
        "set --num_train_epochs > 0 or --max_steps > 0",
    ),
    Rule(
        "token_budget_fits_max_length",
        lambda c, f: 0 < c.train.max_tokens_per_batch < c.data.max_length,
        "--max_tokens_per_batch {max_tokens_per_batch} is below --max_length {max_length}: the "
        "longest samples would not fit; raise it or lower --max_length",
    ),
    Rule(
        "dataset_given",
        lambda c, f: (
            f.method is not None
            and not c.data.dataset
            and (not f.method.default_datasets or c.model.model is not None)
        ),
        "--dataset is required (a .jsonl/.json/.csv/.parquet/.txt file or hub id)",
    ),
    Rule(
        "method_shares_rows",
        lambda c, f: (
            f.method is not None
            and not f.method.supports_packing
            and (c.train.packing or bool(c.train.padding_free))
        ),
        "--packing and --padding_free are not available with {method.name}: its samples "
        "cannot share a row; drop the flags",
    ),
    Rule(
        "resume_auto_needs_output_dir",
        lambda c, f: c.output.resume_from_checkpoint == "auto" and c.output.output_dir is None,
        "--resume_from_checkpoint auto needs the --output_dir of the run",
    ),
    *TIER_RULES,
)

# ---- training: pipeline parallel --------------------------------------------------------------


def pipeline(d: DistArguments) -> bool:
    """The flags ask for pipeline stages."""
    return d.pipeline_parallel_size > 1 or d.strategy == "pp"


def tensor_parallel(d: DistArguments) -> bool:
    """The flags ask for tensor parallel."""
    return d.tensor_parallel_size > 1 or d.strategy == "tp"


def deepspeed(d: DistArguments) -> bool:
    """The flags ask for DeepSpeed."""
    return d.deepspeed is not None or d.strategy == "deepspeed"


PIPELINE_RULES = (
    Rule(
        "pipeline_fixed_shapes",
        lambda c, f: (
            pipeline(c.dist)
            and (c.train.packing or bool(c.train.padding_free) or c.train.max_tokens_per_batch > 0)
        ),
        "--packing, --padding_free and --max_tokens_per_batch are not available with "
        "--pipeline_parallel_size (its stages need fixed shapes)",
    ),
    Rule(
        "pipeline_fixed_batch_size",
        lambda c, f: pipeline(c.dist) and c.train.per_device_train_batch_size == AUTO_BATCH_SIZE,
        "--per_device_train_batch_size auto is not available with --pipeline_parallel_size (its "
        "stages exchange fixed shapes); give a number",
    ),
    Rule(
        "pipeline_without_evaluation",
        lambda c, f: pipeline(c.dist) and bool(c.data.val_dataset or c.data.split_dataset_ratio),
        "evaluation is not available with --pipeline_parallel_size yet; drop --val_dataset and "
        "--split_dataset_ratio",
    ),
    Rule(
        "pipeline_without_float16",
        lambda c, f: pipeline(c.dist) and c.model.torch_dtype == "float16",
        "--torch_dtype float16 is not available with --pipeline_parallel_size (its schedule runs "
        "backward without fp16 loss scaling); use bfloat16 or float32",
    ),
)

# ---- training: distributed engines ------------------------------------------------------------
# What combines: DDP or FSDP2 (--fsdp) as data parallel, each with --pipeline_parallel_size or
# --tensor_parallel_size over the other processes; DeepSpeed alone.

# (asks for it, its name): the engines that replace DDP's plain gradient all-reduce.
ENGINES_BESIDES_DDP = (
    (deepspeed, "DeepSpeed"),
    (pipeline, "pipeline parallel"),
    (tensor_parallel, "tensor parallel"),
    (lambda d: d.fsdp is not None or d.strategy == "fsdp2", "FSDP2"),
)


def _engine_besides_ddp(d: DistArguments) -> str | None:
    return next((name for asks, name in ENGINES_BESIDES_DDP if asks(d)), None)


ENGINE_RULES = (
    Rule(
        "node_rank_below_nnodes",
        lambda c, f: c.dist.node_rank >= node_range(c.dist.nnodes)[1],
        "--node_rank {node_rank} must be below --nnodes {nnodes} (ranks 0 .. nnodes-1)",
    ),
    Rule(
        "elastic_needs_output_dir",
        lambda c, f: c.dist.elastic and c.output.output_dir is None,
        "--nnodes {nnodes}: an elastic job needs --output_dir, the same on every node: the "
        "workers of every membership change resume from its newest checkpoint",
    ),
    Rule(
        "elastic_keeps_its_run",
        lambda c, f: c.dist.elastic and (c.output.add_version or c.output.overwrite_output_dir),
        "--nnodes {nnodes}: the workers of an elastic job restart with the same command line "
        "at every membership change and continue the run in --output_dir {output_dir}; drop "
        "--add_version / --overwrite_output_dir (pass a new --output_dir, or delete the old "
        "run yourself)",
    ),
    Rule(
        "elastic_resumes_its_run",
        lambda c, f: c.dist.elastic and c.output.resume_from_checkpoint not in (None, "auto"),
        "--nnodes {nnodes}: the workers of an elastic job resume from the newest checkpoint in "
        "--output_dir {output_dir} at every membership change, not from "
        "--resume_from_checkpoint {resume_from_checkpoint}; copy that checkpoint into "
        "{output_dir}/checkpoints/ and pass --resume_from_checkpoint auto",
    ),
    Rule(
        "deepspeed_alone",
        lambda c, f: (
            c.dist.deepspeed is not None
            and (c.dist.pipeline_parallel_size > 1 or c.dist.tensor_parallel_size > 1)
        ),
        "--deepspeed owns the model and optimizer and cannot be combined with "
        "--pipeline_parallel_size / --tensor_parallel_size; drop --deepspeed and use "
        "--fsdp fsdp2 for sharded data parallel with them",
    ),
    Rule(
        "deepspeed_one_engine",
        lambda c, f: (
            c.dist.deepspeed is not None
            and (c.dist.fsdp is not None or c.dist.strategy not in ("auto", "deepspeed"))
        ),
        "--deepspeed conflicts with --fsdp / --strategy; pick one engine",
    ),
    Rule(
        "strategy_deepspeed_needs_config",
        lambda c, f: c.dist.strategy == "deepspeed" and c.dist.deepspeed is None,
        "--strategy deepspeed needs --deepspeed zero1|zero2|zero3|<config.json>",
    ),
    Rule(
        "fsdp_with_strategy",
        lambda c, f: c.dist.fsdp is not None and c.dist.strategy in ("single", "ddp"),
        "--fsdp conflicts with --strategy {strategy}",
    ),
    Rule(
        "pipeline_with_tensor_parallel",
        lambda c, f: pipeline(c.dist) and tensor_parallel(c.dist),
        "--pipeline_parallel_size with --tensor_parallel_size is not supported yet; use one of "
        "them (each combines with data parallel over the other processes)",
    ),
    Rule(
        "ddp_with_tensor_parallel",
        lambda c, f: c.dist.strategy == "ddp" and c.dist.tensor_parallel_size > 1,
        "--strategy ddp cannot replicate tensor-parallel (DTensor) weights; with "
        "--tensor_parallel_size the data-parallel groups use FSDP2: drop --strategy ddp",
    ),
    Rule(
        "tensor_parallel_without_dora",
        lambda c, f: tensor_parallel(c.dist) and c.tuner.train_type == "dora",
        "--tensor_parallel_size with --train_type dora: DoRA normalizes each full weight "
        "column, which tensor parallel splits; use lora, or fsdp2 for DoRA",
    ),
    Rule(
        "grad_compression_needs_ddp",
        lambda c, f: c.dist.grad_compression != "none" and _engine_besides_ddp(c.dist) is not None,
        lambda c, f: (
            f"--grad_compression {c.dist.grad_compression} compresses DDP's all-reduce; "
            f"{_engine_besides_ddp(c.dist)} does not use it: drop the flag or use DDP"
        ),
    ),
    Rule(
        "incremental_checkpoints_need_ddp",
        lambda c, f: c.dist.incremental_checkpoints and _engine_besides_ddp(c.dist) is not None,
        lambda c, f: (
            "--incremental_checkpoints stores one process's or DDP's full tensors as blocks; "
            f"{_engine_besides_ddp(c.dist)} writes its own checkpoint format (sharded or per "
            "stage): drop --incremental_checkpoints or use one process or DDP"
        ),
    ),
    Rule(
        "freeze_parameters_need_full",
        lambda c, f: bool(c.tuner.freeze_parameters) and c.tuner.train_type != "full",
        "--freeze_parameters freezes parts of a full fine-tuning run (--train_type full); with "
        "--train_type {train_type} only the adapters train already: drop --freeze_parameters",
    ),
    Rule(
        "deepspeed_steps_itself",
        lambda c, f: deepspeed(c.dist) and c.train.nonfinite_loss == "skip",
        "--nonfinite_loss skip is not available with --deepspeed: its engine steps on its own "
        "schedule (its fp16 loss scaler skips overflowing steps itself)",
    ),
    Rule(
        "single_is_one_process",
        lambda c, f: c.dist.strategy == "single" and f.world_size > 1,
        "--strategy single cannot run with several processes; use ddp or fsdp2",
    ),
    Rule(
        "split_size_divides_world",
        lambda c, f: (
            f.world_size > 1
            and c.dist.deepspeed is None
            and f.world_size % (c.dist.pipeline_parallel_size * c.dist.tensor_parallel_size) != 0
        ),
        lambda c, f: (
            f"--{'pipeline' if c.dist.pipeline_parallel_size > 1 else 'tensor'}_parallel_size "
            f"{c.dist.pipeline_parallel_size * c.dist.tensor_parallel_size} must divide the "
            f"number of processes ({f.world_size}): the rest of the world forms data-parallel "
            "groups"
        ),
    ),
)

# ---- training: a quantized base (QLoRA) -------------------------------------------------------


def _quantized(c: Any) -> bool:
    return c.quant.quant_method is not None


QLORA_RULES = (
    Rule(
        "quant_bits_need_quant_method",
        lambda c, f: not _quantized(c) and c.quant.quant_bits is not None,
        "--quant_bits {quant_bits} without --quant_method: add --quant_method bnb to train on a "
        "quantized base (QLoRA), or drop --quant_bits",
    ),
    Rule(
        "qlora_with_bitsandbytes",
        lambda c, f: _quantized(c) and c.quant.quant_method != "bnb",
        "--quant_method {quant_method}: training quantizes the frozen base with bitsandbytes "
        "only; use --quant_method bnb (int8, int4, gptq and awq are `swiftlm export` formats)",
    ),
    BNB_BITS_RULE,
    Rule(
        "qlora_trains_adapters",
        lambda c, f: _quantized(c) and c.tuner.train_type == "full",
        "--train_type full with --quant_method {quant_method}: quantized weights are frozen and "
        "only adapters train (QLoRA); use --train_type lora or dora, or drop --quant_method",
    ),
    # DeepSpeed trains, but its checkpoints do not resume: the engine reloads the whole module
    # state strictly, and bitsandbytes' quantization-state entries are not parameters it can
    # load back.
    Rule(
        "qlora_without_deepspeed",
        lambda c, f: _quantized(c) and deepspeed(c.dist),
        "--quant_method {quant_method} with --deepspeed: DeepSpeed checkpoints of a "
        "bitsandbytes base cannot be resumed; use DDP (the default with --nproc_per_node) or "
        "--fsdp fsdp2",
    ),
    Rule(
        "qlora_without_tensor_parallel",
        lambda c, f: _quantized(c) and tensor_parallel(c.dist),
        "--quant_method {quant_method} with tensor parallelism: bitsandbytes layers cannot be "
        "split into DTensor shards; use DDP (the default with --nproc_per_node) or --fsdp fsdp2",
    ),
    Rule(
        "qlora_without_pipeline",
        lambda c, f: _quantized(c) and pipeline(c.dist),
        "--quant_method {quant_method} with --pipeline_parallel_size: bitsandbytes layers are "
        "not supported inside pipeline stages; use DDP (the default with --nproc_per_node) or "
        "--fsdp fsdp2",
    ),
)

# ---- training: sequence parallel (distributed/sequence_parallel.py) ---------------------------


# Their losses read whole answers' log-prob sums, which the shards sum over their group.
SEQUENCE_PARALLEL_RLHF = ("dpo", "simpo", "orpo", "cpo", "kto")


def _sequence_parallel(c: Any) -> bool:
    return c.dist.sequence_parallel_size > 1


SEQUENCE_PARALLEL_RULES = (
    Rule(
        "sequence_parallel_divides_world",
        lambda c, f: _sequence_parallel(c) and f.world_size % c.dist.sequence_parallel_size != 0,
        "--sequence_parallel_size {sequence_parallel_size} must divide the number of processes "
        "({world_size}): the rest of the world forms data-parallel groups; launch a multiple "
        "of it with --nproc_per_node",
    ),
    Rule(
        "sequence_parallel_for_token_losses",
        lambda c, f: (
            _sequence_parallel(c)
            and isinstance(c, RLHFConfig)
            and c.rlhf.rlhf_type not in SEQUENCE_PARALLEL_RLHF
        ),
        "--sequence_parallel_size {sequence_parallel_size} with --rlhf_type {rlhf_type}: its "
        "rollouts (grpo, gkd) or last-token scores (rm) are not cut into sequence shards; "
        "sft, pt and the preference methods (" + ", ".join(SEQUENCE_PARALLEL_RLHF) + ") take it",
    ),
    Rule(
        "sequence_parallel_alone",
        lambda c, f: _sequence_parallel(c) and (pipeline(c.dist) or deepspeed(c.dist)),
        "--sequence_parallel_size {sequence_parallel_size} with pipeline or DeepSpeed "
        "parallelism: sequence shards run beside DDP (the default), --fsdp fsdp2 or "
        "--tensor_parallel_size only",
    ),
)

# ---- training: expert parallel (distributed/expert_parallel.py) -------------------------------
# What needs the model (experts at all, experts that divide by N, LoRA on the experts) is
# checked when the experts are split: distributed/expert_parallel.check_expert_parallel.


def _expert_parallel(c: Any) -> bool:
    return c.dist.expert_parallel_size > 1


EXPERT_PARALLEL_RULES = (
    Rule(
        "expert_parallel_divides_world",
        lambda c, f: _expert_parallel(c) and f.world_size % c.dist.expert_parallel_size != 0,
        "--expert_parallel_size {expert_parallel_size} must divide the data-parallel processes "
        "({world_size}): each group of {expert_parallel_size} splits the experts among itself; "
        "launch a multiple of it with --nproc_per_node",
    ),
    Rule(
        "expert_parallel_for_sft_and_pt",
        lambda c, f: _expert_parallel(c) and isinstance(c, RLHFConfig),
        "--expert_parallel_size {expert_parallel_size} with swiftlm rlhf: every forward is a "
        "collective of the expert group, and the methods' generations and reference passes do "
        "not run in step on every rank (not built yet); sft and pt take it",
    ),
    Rule(
        "expert_parallel_with_ddp",
        lambda c, f: (
            _expert_parallel(c)
            and (
                tensor_parallel(c.dist)
                or pipeline(c.dist)
                or deepspeed(c.dist)
                or _sequence_parallel(c)
            )
        ),
        "--expert_parallel_size {expert_parallel_size} with tensor, pipeline, sequence or "
        "DeepSpeed parallelism: expert shards run beside DDP (the default with "
        "--nproc_per_node) or --fsdp fsdp2 only; drop one of the two",
    ),
    Rule(
        "expert_parallel_without_fsdp_offload",
        lambda c, f: _expert_parallel(c) and c.dist.fsdp_offload,
        "--expert_parallel_size {expert_parallel_size} with --fsdp_offload: FSDP2 leaves the "
        "expert shards out of its units, so they would stay on the GPU while their optimizer "
        "steps beside offloaded weights (not built); drop --fsdp_offload",
    ),
    Rule(
        "expert_parallel_without_compile",
        lambda c, f: _expert_parallel(c) and c.train.torch_compile,
        "--expert_parallel_size {expert_parallel_size} with --torch_compile: the token exchange "
        "reads its split sizes on the host in every MoE layer, which compiled layers do not "
        "take; drop --torch_compile",
    ),
    Rule(
        "expert_parallel_without_generation_eval",
        lambda c, f: _expert_parallel(c) and bool(c.evaluation.eval_dataset),
        "--eval_dataset with --expert_parallel_size {expert_parallel_size}: generation runs on "
        "rank 0 alone, and each MoE layer waits on the expert group's all-to-all; evaluate the "
        "checkpoints with `swiftlm eval --ckpt_dir RUN/checkpoints/step-N` instead",
    ),
)

# ---- training: FP8 (models/fp8.py) ------------------------------------------------------------

FP8_RULES = (
    Rule(
        "fp8_not_on_a_quantized_base",
        lambda c, f: c.train.fp8_recipe is not None and _quantized(c),
        "--fp8_recipe {fp8_recipe} with --quant_method {quant_method}: the frozen base is "
        "already quantized by bitsandbytes, whose layers float8 cannot convert; drop one",
    ),
    Rule(
        "fp8_without_deepspeed_or_tensor_parallel",
        lambda c, f: (
            c.train.fp8_recipe is not None and (deepspeed(c.dist) or tensor_parallel(c.dist))
        ),
        "--fp8_recipe {fp8_recipe} with DeepSpeed or tensor parallelism: float8 layers need "
        "their own sharding rules there, which swiftlm does not apply; use DDP (the default "
        "with --nproc_per_node) or --fsdp fsdp2",
    ),
)

# ---- infer ------------------------------------------------------------------------------------

# Both commands load their model through `checkpoint/resolve.py`, which reads one of the two.

INFER_RULES = (
    Rule(
        "prompts_from_val_dataset",
        lambda c, f: bool(c.data.dataset) and not c.data.val_dataset,
        lambda c, f: (
            "swiftlm infer reads prompts from --val_dataset, not --dataset; "
            f"use --val_dataset {' '.join(c.data.dataset)}"
        ),
    ),
    Rule(
        "result_path_needs_prompts",
        lambda c, f: bool(c.infer.result_path) and not c.data.val_dataset,
        "--result_path is for batch mode; give the prompts with --val_dataset",
    ),
    Rule(
        "score_needs_conversations",
        lambda c, f: c.infer.task == "score" and not c.data.val_dataset,
        "--task score scores the conversations of --val_dataset (each ending with the answer "
        "to score); give them with --val_dataset",
    ),
    Rule(
        "images_are_for_chat",
        lambda c, f: (
            bool(c.infer.images) and (bool(c.data.val_dataset) or c.infer.task != "generate")
        ),
        "--images attaches images to the chat's first question; --val_dataset rows carry their "
        "own (<image> tags with an `images` column, or image_url parts): drop --images",
    ),
    CKPT_DIR_OR_ADAPTERS_RULE,
)

RULES: dict[type, tuple[Rule, ...]] = {
    TrainConfig: TRAIN_RULES
    + RUN_DIR_RULES
    + PIPELINE_RULES
    + ENGINE_RULES
    + QLORA_RULES
    + FP8_RULES
    + SEQUENCE_PARALLEL_RULES
    + EXPERT_PARALLEL_RULES
    + TRAIN_EVAL_RULES
    + STREAMING_RULES
    + OPTIM_RULES
    + TUNER_RULES,
    InferConfig: INFER_RULES,
    EvalConfig: EVAL_RULES,
    ExportConfig: EXPORT_RULES,
}
