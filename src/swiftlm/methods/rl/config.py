"""The config sections of the online methods of `swiftlm rlhf`, GRPO (rollouts, advantages,
rewards) and GKD (the teacher), and their flag facts (`methods.flags.MethodFlags`). Same
conventions as `config/sections.py`. Both sample from the policy through the serving
engine, so the sampling flags (`--max_completion_length`, `--temperature`, `--top_p`) and the
rollout engine's (`--infer_backend`, `--vllm_*`) live in the GRPO section and GKD reads them too.
"""

from dataclasses import dataclass, fields
from typing import Literal

from swiftlm.config.checks import above, at_least, check_fields, within
from swiftlm.config.sections import doc
from swiftlm.errors import ConfigError
from swiftlm.losses.loss_types import GRPO_LOSS_TYPES
from swiftlm.methods.flags import MethodFlags
from swiftlm.methods.rl.rewards import REWARD_FUNCS

# ms-swift's (and DeepSeek-R1's) reasoning format.
DEFAULT_FORMAT_PATTERN = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
SAMPLING_FLAGS = frozenset({"max_completion_length", "temperature", "top_p"})
# The engine the rollouts run on: GKD's on-policy samples too.
ROLLOUT_ENGINE_FLAGS = frozenset({
    "infer_backend", "vllm_mode", "vllm_server_host", "vllm_server_port", "vllm_group_port",
    "vllm_server_timeout", "vllm_enforce_eager", "vllm_gpu_memory_utilization",
})  # fmt: skip


@dataclass
class GRPOArguments:
    num_generations: int = doc(
        "grpo: completions sampled per prompt (a group). --per_device_train_batch_size counts "
        "completions, as in TRL and ms-swift, and must be a multiple of it.",
        default=8,
    )
    max_completion_length: int | None = doc(
        "grpo, gkd: tokens sampled per completion at most. Default: 256 (grpo), 128 (gkd).",
        default=None,
    )
    temperature: float | None = doc(
        "grpo, gkd: sampling temperature of the rollouts; the trainer scales its logits by "
        "the same value. Default: 1.0 (grpo), 0.9 (gkd).",
        default=None,
    )
    top_p: float = doc("grpo, gkd: nucleus sampling of the rollouts.", default=1.0)
    epsilon: float = doc("grpo: the clip range of the importance ratio (low side).", default=0.2)
    epsilon_high: float | None = doc(
        "grpo: the clip range's high side (DAPO's clip-higher). Default: --epsilon.", default=None
    )
    importance_sampling_level: Literal["token", "sequence"] = doc(
        "grpo: the importance ratio per token (GRPO) or per sequence (GSPO).", default="token"
    )
    scale_rewards: Literal["group", "batch", "none"] = doc(
        "grpo: divide advantages by the reward std of the group, of the whole step (over every "
        "rank), or not at all (Dr. GRPO).",
        default="group",
    )
    advantage_estimator: Literal["grpo", "rloo"] = doc(
        "grpo: the baseline of a completion's reward: its group's mean (grpo) or the mean of "
        "the others of its group (rloo).",
        default="grpo",
    )
    dynamic_sample: bool = doc(
        "grpo: sample a group again (new seeds) while all its rewards agree, up to "
        "--max_resample_times (DAPO's dynamic sampling, on the same prompts).",
        default=False,
    )
    max_resample_times: int = doc("grpo: resampling rounds of --dynamic_sample.", default=3)
    steps_per_generation: int | None = doc(
        "grpo: micro-batches trained on the completions of one generation (TRL's and "
        "ms-swift's meaning). Default: --gradient_accumulation_steps, one generation per "
        "optimizer step; a multiple of it reuses a generation over several optimizer steps "
        "(then the importance ratio and the clip matter).",
        default=None,
    )
    async_generate: bool = doc(
        "grpo: sample the next generation in a background thread while this one trains, "
        "from a copy of the policy taken as it starts (one generation off-policy; the copy's "
        "log-probs are the importance ratio's old ones, `importance_ratio` is logged). One "
        "process, --infer_backend pt; the copy shares a LoRA run's frozen base weights.",
        default=False,
    )
    reward_funcs: list[str] = doc(
        "grpo: reward functions, built in (accuracy: the completion's final answer equals the "
        "row's `solution`, numbers compared as numbers; format: the completion matches "
        "--format_pattern; length: DAPO's soft over-long penalty; repetition: minus the "
        "share of repeated n-grams) or `file.py:function` (called as "
        "function(prompts=, completions=, **row columns) -> one float per completion).",
        default_factory=lambda: ["accuracy"],
    )
    reward_weights: list[float] | None = doc(
        "grpo: one weight per --reward_funcs entry. Default: 1 each.", default=None
    )
    reward_timeout: float = doc(
        "grpo: seconds a user reward function may take per call; a call that takes longer or "
        "raises is reported with its sample and counted, and gives no reward (the run goes on).",
        default=30.0,
    )
    format_pattern: str = doc(
        "grpo: the regular expression of the `format` reward (full match, dot matches newline).",
        default=DEFAULT_FORMAT_PATTERN,
    )
    soft_cache_length: int | None = doc(
        "grpo: the `length` reward's ramp: completions longer than --max_completion_length "
        "minus this lose reward linearly, down to -1 at the limit. Default: a quarter of "
        "--max_completion_length.",
        default=None,
    )
    repetition_n_grams: int = doc("grpo: the n of the `repetition` reward.", default=3)
    infer_backend: Literal["pt", "vllm"] = doc(
        "grpo, gkd: the engine the rollouts run on. pt: swiftlm's, over the live policy module "
        "(no copy of the weights). vllm: vLLM (--vllm_mode), its weights (LoRA merged) pushed "
        "from the policy before every generation; GRPO corrects the mismatch of its log-probs "
        "with the trainer's (--vllm_importance_sampling_correction). One trainer process, "
        "LoRA or full, not quantized.",
        default="pt",
    )
    vllm_mode: Literal["colocate", "server"] = doc(
        "grpo, gkd --infer_backend vllm: colocate: vLLM in the trainer's process, its weights "
        "reloaded from a shared-memory folder. server: a `swiftlm rollout` server at "
        "--vllm_server_host/--vllm_server_port, its weights broadcast over a process group of "
        "the two (gloo; NCCL when both are on GPUs), as `trl vllm-serve` does.",
        default="colocate",
    )
    vllm_server_host: str = doc(
        "grpo, gkd --vllm_mode server: the `swiftlm rollout` server's address.",
        default="127.0.0.1",
    )
    vllm_server_port: int = doc(
        "grpo, gkd --vllm_mode server: the `swiftlm rollout` server's HTTP port.", default=8000
    )
    vllm_group_port: int = doc(
        "grpo, gkd --vllm_mode server: the TCP port, on the server's machine, of the process "
        "group the weights are broadcast over.",
        default=51216,
    )
    vllm_server_timeout: float = doc(
        "grpo, gkd --vllm_mode server: seconds to wait for the server to answer /health/ "
        "(it may still be loading), and for each generation or weight push.",
        default=240.0,
    )
    vllm_enforce_eager: bool = doc(
        "grpo, gkd --infer_backend vllm (colocate): run vLLM eagerly (no torch.compile or "
        "CUDA graphs).",
        default=False,
    )
    vllm_gpu_memory_utilization: float = doc(
        "grpo, gkd --infer_backend vllm (colocate) on a GPU: the share of its memory vLLM may "
        "take; the trainer shares the GPU. On a CPU vLLM reads VLLM_CPU_KVCACHE_SPACE (GiB).",
        default=0.3,
    )
    vllm_importance_sampling_correction: bool = doc(
        "grpo --infer_backend vllm: weigh each token's policy loss by exp(trainer log-prob - "
        "vLLM's log-prob), capped at --vllm_importance_sampling_cap (truncated importance "
        "sampling, as TRL and verl do): vLLM's kernels sample from a slightly different "
        "distribution than the one the trainer computes.",
        default=True,
    )
    vllm_importance_sampling_cap: float = doc(
        "grpo: the cap of the truncated importance weight.", default=3.0
    )

    def __post_init__(self):
        check_fields(
            self,
            num_generations=at_least(2, note="advantages compare a completion with its group"),
            max_completion_length=at_least(1),
            temperature=above(0, note="the policy is sampled; 0 would be greedy"),
            top_p=within(0, 1, open_low=True),
            epsilon=within(0, 1, open_low=True),
            epsilon_high=within(0, 10, open_low=True),
            max_resample_times=at_least(1),
            steps_per_generation=at_least(1),
            reward_timeout=above(0),
            soft_cache_length=at_least(1),
            repetition_n_grams=at_least(1),
            vllm_gpu_memory_utilization=within(0, 1, open_low=True),
            vllm_importance_sampling_cap=above(0),
            vllm_server_port=within(1, 65535),
            vllm_group_port=within(1, 65535),
            vllm_server_timeout=above(0),
        )


@dataclass
class GKDArguments:
    teacher_model: str | None = doc(
        "gkd: the teacher (a folder, hub id or .gguf), with the student's tokenizer.",
        default=None,
    )
    lmbda: float = doc(
        "gkd: the share of steps trained on the student's own samples (on-policy); the others "
        "train on the dataset's answers.",
        default=0.5,
    )
    seq_kd: bool = doc(
        "gkd: on the off-policy steps, train on the teacher's samples instead of the "
        "dataset's answers (sequence-level KD).",
        default=False,
    )
    gkd_logits_topk: int | None = doc(
        "gkd: compare the distributions on the teacher's top-k tokens only (saves memory on "
        "large vocabularies). None: the whole vocabulary.",
        default=None,
    )

    def __post_init__(self):
        check_fields(self, lmbda=within(0, 1), gkd_logits_topk=at_least(1))


def _check_grpo(rlhf, grpo: GRPOArguments, gkd: GKDArguments) -> None:
    if grpo.reward_weights is not None and len(grpo.reward_weights) != len(grpo.reward_funcs):
        raise ConfigError(
            f"--reward_weights: {len(grpo.reward_weights)} weights for "
            f"{len(grpo.reward_funcs)} --reward_funcs; give one weight per function"
        )
    for name in grpo.reward_funcs:
        if name not in REWARD_FUNCS and ":" not in name:
            known = ", ".join(REWARD_FUNCS)
            raise ConfigError(
                f"--reward_funcs {name}: not a built-in or plugin reward ({known}) "
                "nor `file.py:function`"
            )
    if grpo.soft_cache_length is not None and grpo.soft_cache_length >= grpo.max_completion_length:
        raise ConfigError(
            f"--soft_cache_length {grpo.soft_cache_length} must be below "
            f"--max_completion_length {grpo.max_completion_length}"
        )


def _check_gkd(rlhf, grpo: GRPOArguments, gkd: GKDArguments) -> None:
    if not gkd.teacher_model:
        raise ConfigError("--rlhf_type gkd needs --teacher_model (a folder, hub id or .gguf)")


def _names(section) -> frozenset[str]:
    return frozenset(f.name for f in fields(section))


# beta: GRPO's KL weight (0 drops the KL term and the reference); GKD's generalized JSD
# interpolation (0 forward KL, 1 reverse). GKD samples at 0.9, as TRL's and ms-swift's.
GRPO_FLAGS = MethodFlags(
    loss_types=GRPO_LOSS_TYPES,
    beta=0.04,
    beta_check=at_least(0),
    reads=_names(GRPOArguments) | {"ref_model"},
    defaults={"temperature": 1.0, "max_completion_length": 256},
    check=_check_grpo,
)
GKD_FLAGS = MethodFlags(
    beta=0.5,
    beta_check=within(0, 1),
    reads=_names(GKDArguments) | SAMPLING_FLAGS | ROLLOUT_ENGINE_FLAGS,
    defaults={"temperature": 0.9, "max_completion_length": 128},
    check=_check_gkd,
)

ONLINE_METHODS = {"grpo": GRPO_FLAGS, "gkd": GKD_FLAGS}
