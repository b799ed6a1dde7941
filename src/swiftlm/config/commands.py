"""Command configs: each is a composition of typed sections (see `sections.py`)."""

from dataclasses import dataclass, field, fields

from swiftlm.config.sections import (
    DataArguments,
    ModelArguments,
    OutputArguments,
    OverwriteArguments,
    QuantArguments,
    TrainArguments,
    TunerArguments,
)
from swiftlm.config.sections_dist import DistArguments
from swiftlm.config.sections_eval import EvalArguments, TrainEvalArguments
from swiftlm.config.sections_infer import ExportArguments, GenerationArguments, InferArguments
from swiftlm.config.sections_monitor import MonitorArguments
from swiftlm.config.sections_online import GKDArguments, GRPOArguments, settle_online
from swiftlm.config.sections_plan import PlanArguments
from swiftlm.config.sections_plugins import PluginArguments, TrainPluginArguments
from swiftlm.config.sections_report import ReportArguments
from swiftlm.config.sections_rlhf import RLHFArguments
from swiftlm.config.sections_serve import DeployArguments
from swiftlm.config.sections_web import WebArguments


@dataclass
class TrainConfig:
    """`swiftlm sft` and `swiftlm pt`: everything a training run needs."""

    model: ModelArguments = field(default_factory=ModelArguments)
    data: DataArguments = field(default_factory=DataArguments)
    tuner: TunerArguments = field(default_factory=TunerArguments)
    quant: QuantArguments = field(default_factory=QuantArguments)
    train: TrainArguments = field(default_factory=TrainArguments)
    output: OutputArguments = field(default_factory=OutputArguments)
    dist: DistArguments = field(default_factory=DistArguments)
    monitor: MonitorArguments = field(default_factory=MonitorArguments)
    evaluation: TrainEvalArguments = field(default_factory=TrainEvalArguments)
    plugins: TrainPluginArguments = field(default_factory=TrainPluginArguments)


@dataclass
class RLHFConfig(TrainConfig):
    """`swiftlm rlhf`: a training run with an alignment method, and the method's settings."""

    rlhf: RLHFArguments = field(default_factory=RLHFArguments)
    grpo: GRPOArguments = field(default_factory=GRPOArguments)
    gkd: GKDArguments = field(default_factory=GKDArguments)
    # rlhf's --loss_type is the method's (rlhf section); plugin losses are sft/pt's.
    plugins: PluginArguments = field(default_factory=PluginArguments)

    def __post_init__(self):
        settle_online(self.rlhf.rlhf_type, self.grpo, self.gkd)


@dataclass
class InferConfig:
    """`swiftlm infer`: a model (or run) to load, prompts and sampling settings."""

    model: ModelArguments = field(default_factory=ModelArguments)
    data: DataArguments = field(default_factory=DataArguments)
    generation: GenerationArguments = field(default_factory=GenerationArguments)
    infer: InferArguments = field(default_factory=InferArguments)
    overwrite: OverwriteArguments = field(default_factory=OverwriteArguments)
    plugins: PluginArguments = field(default_factory=PluginArguments)


@dataclass
class EvalConfig:
    """`swiftlm eval`: a model (or run, or served endpoint), tasks, and how to sample answers."""

    model: ModelArguments = field(default_factory=ModelArguments)
    data: DataArguments = field(default_factory=DataArguments)  # --dataset, --system
    generation: GenerationArguments = field(default_factory=GenerationArguments)
    infer: InferArguments = field(default_factory=InferArguments)
    eval: EvalArguments = field(default_factory=EvalArguments)
    overwrite: OverwriteArguments = field(default_factory=OverwriteArguments)
    plugins: PluginArguments = field(default_factory=PluginArguments)


@dataclass
class ExportConfig:
    """`swiftlm export`: a model (or run) to load and what to write."""

    model: ModelArguments = field(default_factory=ModelArguments)
    data: DataArguments = field(default_factory=DataArguments)
    infer: InferArguments = field(default_factory=InferArguments)
    export: ExportArguments = field(default_factory=ExportArguments)
    quant: QuantArguments = field(default_factory=QuantArguments)
    overwrite: OverwriteArguments = field(default_factory=OverwriteArguments)
    plugins: PluginArguments = field(default_factory=PluginArguments)


@dataclass
class DeployConfig:
    """`swiftlm deploy`: a model (or run) and its adapters, served over an OpenAI-compatible API."""

    model: ModelArguments = field(default_factory=ModelArguments)
    data: DataArguments = field(default_factory=DataArguments)  # only --system is used
    infer: InferArguments = field(default_factory=InferArguments)
    deploy: DeployArguments = field(default_factory=DeployArguments)
    plugins: PluginArguments = field(default_factory=PluginArguments)


# Flags of a command's config that the command does not use: left out of its parser and
# `--help`, and an error when given (flag or YAML key). A test runs each command's parser.
_EXPORT_ONLY = frozenset({"group_size", "quant_n_samples"})
_SFT_ONLY = frozenset({"system", "loss_scope", "truncation_strategy", "model_name", "model_author"})
# Flags of vision-language training (sft, dpo).
_VISION_TRAINING = frozenset(
    {"max_pixels", "freeze_vit", "freeze_aligner", "freeze_llm", "dataset_num_proc"}
)
# --streaming reads pre-training text while training (sft and rlhf refuse it: not their flag).
_PT_ONLY = frozenset({"streaming", "shuffle_buffer_size"})
UNUSED_FLAGS: dict[str, frozenset[str]] = {
    "sft": _EXPORT_ONLY | _PT_ONLY,
    # Pre-training reads plain text cut into --max_length chunks: no chat, no truncation.
    # --dataset_num_proc: the processes that tokenize local text into token shards.
    "pt": _EXPORT_ONLY | _SFT_ONLY | (_VISION_TRAINING - {"dataset_num_proc"}),
    # The loss is on each pair's last answer; there is no self-cognition data to fill in.
    # Pairs are preprocessed in the main process (--dataset_num_proc is sft's).
    "rlhf": _EXPORT_ONLY
    | _PT_ONLY
    | frozenset({"loss_scope", "model_name", "model_author", "dataset_num_proc"}),
    # Prompts come from --val_dataset; answers are bounded by --max_new_tokens.
    "infer": frozenset(
        {
            "dataset_num_proc",
            "dataset",
            "split_dataset_ratio",
            "max_length",
            "truncation_strategy",
            "loss_scope",
            "load_from_cache_file",
            "streaming",
            "shuffle_buffer_size",
        }
    ),
    # --dataset is calibration data for gptq/awq, rendered like training with every token kept.
    "export": frozenset(
        {
            "dataset_num_proc",
            "val_dataset",
            "split_dataset_ratio",
            "truncation_strategy",
            "loss_scope",
            "load_from_cache_file",
            "result_path",
            "max_batch_size",
            "stream",
            "streaming",
            "shuffle_buffer_size",
            "seed",
            "task",
            "max_pixels",
            "images",
        }
    ),
    # Requests bring their own prompts and sampling; --system is the one data flag kept.
    "deploy": frozenset(
        {
            "dataset_num_proc",
            "dataset",
            "val_dataset",
            "split_dataset_ratio",
            "max_length",
            "truncation_strategy",
            "loss_scope",
            "skip_bad_rows",
            "data_seed",
            "load_from_cache_file",
            "result_path",
            "max_batch_size",
            "stream",
            "streaming",
            "shuffle_buffer_size",
            "task",  # a reward model is served for scoring (/v1/score), found from its files
            "images",  # requests bring their images as image_url parts
        }
    ),
    # Tasks bring their own data; --dataset names the training data of the contamination
    # check (default: the evaluated run's), --system the system prompt of chat tasks.
    "eval": frozenset(
        {
            "dataset_num_proc",
            "val_dataset",
            "split_dataset_ratio",
            "max_length",
            "truncation_strategy",
            "loss_scope",
            "skip_bad_rows",
            "data_seed",
            "load_from_cache_file",
            "result_path",
            "stream",
            "streaming",
            "shuffle_buffer_size",
            "task",
            "max_pixels",
            "images",
        }
    ),
    "report": frozenset(),  # its own section only
    "web": frozenset(),  # its own section only
    # The planner reads the job's shape from the training flags; the others do not change it.
    "plan": (
        frozenset(
            f.name
            for section in (ModelArguments, DataArguments, TunerArguments, TrainArguments)
            for f in fields(section)
        )
        | frozenset(f.name for f in fields(DistArguments))
    )
    - {
        "model",
        "torch_dtype",
        "max_length",
        "train_type",
        "lora_rank",
        "target_modules",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "gradient_checkpointing",
        "fused_cross_entropy",
        "nnodes",
    },
}


@dataclass
class ReportConfig:
    """`swiftlm report`: run directories to draw as one offline page, optionally served live."""

    report: ReportArguments = field(default_factory=ReportArguments)
    overwrite: OverwriteArguments = field(default_factory=OverwriteArguments)
    plugins: PluginArguments = field(default_factory=PluginArguments)


@dataclass
class WebConfig:
    """`swiftlm web`: where the browser UI listens, its key, and the folder its runs live in."""

    web: WebArguments = field(default_factory=WebArguments)
    plugins: PluginArguments = field(default_factory=PluginArguments)


@dataclass
class PlanConfig:
    """`swiftlm plan`: a training job's shape (the training flags) and the devices to plan for."""

    model: ModelArguments = field(default_factory=ModelArguments)
    data: DataArguments = field(default_factory=DataArguments)  # --max_length
    tuner: TunerArguments = field(default_factory=TunerArguments)
    train: TrainArguments = field(default_factory=TrainArguments)
    # --nnodes; not named `dist`, which makes a command launch its processes under torchrun
    nodes: DistArguments = field(default_factory=DistArguments)
    plan: PlanArguments = field(default_factory=PlanArguments)
    overwrite: OverwriteArguments = field(default_factory=OverwriteArguments)
    plugins: PluginArguments = field(default_factory=PluginArguments)
