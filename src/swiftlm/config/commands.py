"""Command configs: each is a composition of typed sections (see `config/sections.py`)."""

from dataclasses import dataclass, field, fields

from swiftlm.config.sections import OverwriteArguments
from swiftlm.data.config import DataArguments
from swiftlm.distributed.config import DistArguments
from swiftlm.engine.config import GenerationArguments
from swiftlm.evaluation.config import EvalArguments, TrainEvalArguments
from swiftlm.export.config import ExportArguments
from swiftlm.infer.config import InferArguments
from swiftlm.methods.config import RLHFArguments, settle_online
from swiftlm.methods.rl.config import GKDArguments, GRPOArguments
from swiftlm.models.config import ModelArguments, QuantArguments
from swiftlm.monitor.config import MonitorArguments
from swiftlm.plan.config import PlanArguments
from swiftlm.plugins.config import PluginArguments, TrainPluginArguments
from swiftlm.report.config import ReportArguments
from swiftlm.serve.config import DeployArguments
from swiftlm.train.config import OutputArguments, TrainArguments
from swiftlm.tuners.config import TunerArguments
from swiftlm.web.config import WebArguments


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
        settle_online(self.rlhf, self.grpo, self.gkd)


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


@dataclass
class RolloutConfig:
    """`swiftlm rollout`: a model on vLLM, served to GRPO/GKD trainers (`--vllm_mode server`)."""

    model: ModelArguments = field(default_factory=ModelArguments)
    infer: InferArguments = field(default_factory=InferArguments)  # --seed, --vllm_*
    deploy: DeployArguments = field(default_factory=DeployArguments)  # address, limits
    plugins: PluginArguments = field(default_factory=PluginArguments)


# What each command reads: per section of its config, every flag (ALL) or the flags named.
# The command's parser, `--help`, the unknown-flag check and the web UI's forms offer exactly
# these; any other flag of the config is an error when given (flag or YAML key).
# tests/unit/test_command_reads.py checks each declared flag exists and is read by the code.
ALL = "all"
# The InferArguments that choose and tune the generation engine (engine.build.EngineOptions):
# read by every command that generates.
ENGINE_FLAGS = (
    "prefix_cache_memory", "speculative_tokens", "packed_weights", "infer_backend",
    "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_enforce_eager",
)  # fmt: skip
_QUANT_TRAINING = ("quant_method", "quant_bits", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant")
_TRAINING = {  # what sft, pt and rlhf read besides model, data, tuner and quant
    "train": ALL,
    "output": ALL,
    "dist": ALL,
    "monitor": ALL,
    "evaluation": ALL,
    "plugins": ALL,
}
READS: dict[str, dict[str, str | tuple[str, ...]]] = {
    "sft": {
        "model": ALL,
        # Not --streaming/--shuffle_buffer_size: streaming reads pre-training text (pt's).
        "data": (
            "dataset", "val_dataset", "split_dataset_ratio", "max_length",
            "truncation_strategy", "system", "loss_scope", "skip_bad_rows", "data_seed",
            "load_from_cache_file", "max_pixels", "dataset_num_proc",
        ),
        "tuner": ALL,  # with the vision freeze flags (sft and dpo train vision models)
        "quant": _QUANT_TRAINING,  # --group_size and --quant_n_samples are export's
        **_TRAINING,
    },
    "pt": {
        # Plain text cut into --max_length chunks: no chat, no truncation, no self-cognition
        # names, no images; --dataset_num_proc tokenizes local text into token shards.
        "model": ("model", "torch_dtype", "device", "attn_impl", "experts_impl"),
        "data": (
            "dataset", "val_dataset", "split_dataset_ratio", "max_length", "skip_bad_rows",
            "data_seed", "load_from_cache_file", "dataset_num_proc", "streaming",
            "shuffle_buffer_size",
        ),
        "tuner": (
            "train_type", "lora_rank", "lora_alpha", "lora_dropout", "target_modules",
            "use_rslora", "modules_to_save", "freeze_parameters",
        ),
        "quant": _QUANT_TRAINING,
        **_TRAINING,
    },
    "rlhf": {
        # The loss is on each pair's last answer; there is no self-cognition data to fill in.
        # Pairs are preprocessed in the main process (--dataset_num_proc is sft's).
        "model": ("model", "torch_dtype", "device", "attn_impl", "experts_impl"),
        "data": (
            "dataset", "val_dataset", "split_dataset_ratio", "max_length",
            "truncation_strategy", "system", "skip_bad_rows", "data_seed",
            "load_from_cache_file", "max_pixels",
        ),
        "tuner": ALL,
        "quant": _QUANT_TRAINING,
        **_TRAINING,
        "rlhf": ALL,
        "grpo": ALL,
        "gkd": ALL,
    },
    "infer": {
        "model": ALL,
        # Prompts come from --val_dataset; answers are bounded by --max_new_tokens.
        "data": ("val_dataset", "system", "skip_bad_rows", "data_seed", "max_pixels"),
        "generation": ALL,
        "infer": ALL,
        "overwrite": ALL,
        "plugins": ALL,
    },
    "eval": {
        "model": ALL,
        # Tasks bring their own data; --dataset names the training data of the contamination
        # check (default: the evaluated run's), --system the system prompt of chat tasks.
        "data": ("dataset", "system"),
        "generation": ALL,
        "infer": (
            "adapters", "ckpt_dir", "max_batch_size", "seed", *ENGINE_FLAGS,
        ),  # fmt: skip
        "eval": ALL,
        "overwrite": ALL,
        "plugins": ALL,
    },
    "export": {
        "model": ALL,
        # --dataset is calibration data for gptq/awq, rendered like training, every token kept.
        "data": ("dataset", "max_length", "system", "skip_bad_rows", "data_seed"),
        "infer": ("adapters", "ckpt_dir"),
        "export": ALL,
        "quant": ALL,
        "overwrite": ALL,
        "plugins": ALL,
    },
    "deploy": {
        "model": ALL,
        # Requests bring their own prompts, sampling and images (image_url parts); a reward
        # model is served for scoring (/v1/score), found from its files.
        "data": ("system", "max_pixels"),
        "infer": ("adapters", "ckpt_dir", "seed", *ENGINE_FLAGS),
        "deploy": ALL,
        "plugins": ALL,
    },
    "rollout": {
        # The trainer's weights replace the model's before every generation; requests are
        # token ids with swiftlm's sampling fields, and there are no API keys (a trainer's
        # internal server, as `trl vllm-serve`).
        "model": ("model", "torch_dtype"),
        "infer": (
            "seed", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
            "vllm_enforce_eager",
        ),
        "deploy": ("host", "port", "max_num_seqs", "max_model_len", "shutdown_timeout"),
        "plugins": ALL,
    },
    "report": {"report": ALL, "overwrite": ALL, "plugins": ALL},
    "web": {"web": ALL, "plugins": ALL},
    "plan": {
        # The job's shape from the training flags; the others do not change it.
        "model": ("model", "torch_dtype"),
        "data": ("max_length",),
        "tuner": ("train_type", "lora_rank", "target_modules"),
        "train": (
            "per_device_train_batch_size", "gradient_accumulation_steps",
            "gradient_checkpointing", "fused_cross_entropy",
        ),
        "nodes": ("nnodes",),
        "plan": ALL,
        "overwrite": ALL,
        "plugins": ALL,
    },
}  # fmt: skip


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
    # --nnodes of the job planned for (the plan itself runs in this process)
    nodes: DistArguments = field(default_factory=DistArguments)
    plan: PlanArguments = field(default_factory=PlanArguments)
    overwrite: OverwriteArguments = field(default_factory=OverwriteArguments)
    plugins: PluginArguments = field(default_factory=PluginArguments)


COMMAND_CONFIGS: dict[str, type] = {
    "sft": TrainConfig,
    "pt": TrainConfig,
    "rlhf": RLHFConfig,
    "infer": InferConfig,
    "eval": EvalConfig,
    "export": ExportConfig,
    "deploy": DeployConfig,
    "rollout": RolloutConfig,
    "report": ReportConfig,
    "web": WebConfig,
    "plan": PlanConfig,
}


def read_flags(command: str) -> frozenset[str]:
    """The flags `command` reads (READS, with ALL spelled out)."""
    reads, sections = READS[command], {f.name: f for f in fields(COMMAND_CONFIGS[command])}
    flags: set[str] = set()
    for name, which in reads.items():
        section = [f.name for f in fields(sections[name].default_factory)]
        flags.update(section if which == ALL else which)
    return frozenset(flags)


def _left_out(command: str) -> frozenset[str]:
    """The flags of `command`'s config that it does not read (derived from READS)."""
    config = COMMAND_CONFIGS[command]
    every = {g.name for f in fields(config) for g in fields(f.default_factory)}
    return frozenset(every - read_flags(command))


# What each command's parser leaves out, derived from READS (its complement in the config).
UNUSED_FLAGS: dict[str, frozenset[str]] = {command: _left_out(command) for command in READS}
