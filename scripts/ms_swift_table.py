"""Write docs/ms-swift-flags.md: how swiftlm reads each common ms-swift flag.

The page is generated from `swiftlm.config.ms_swift` (renamed flags, value rules, unsupported
flags) and from swiftlm's own parsers, so it cannot drift: `--check` (run by the test suite)
fails when the page is stale or when a flag below falls in none of the tables.

    python scripts/ms_swift_table.py          # rewrite the page
    python scripts/ms_swift_table.py --check  # exit 1 if it is not current
"""

import sys
from pathlib import Path

from generated_page import write_or_check

from swiftlm.config import (
    UNUSED_FLAGS,
    DeployConfig,
    EvalConfig,
    ExportConfig,
    InferConfig,
    RLHFConfig,
    TrainConfig,
)
from swiftlm.config.ms_swift import RENAMED, UNSUPPORTED, VALUE_RULES
from swiftlm.config.parse import flag_owners
from swiftlm.errors import ConfigError

PAGE = Path(__file__).resolve().parents[1] / "docs" / "ms-swift-flags.md"

# ms-swift 4.x's documented arguments (its docs' "command line parameters" page), plus the
# 2.x/3.x spellings still found in users' scripts.
MS_SWIFT_FLAGS = """
model model_type model_revision task_type torch_dtype attn_impl device_map max_memory
rope_scaling max_model_len new_special_tokens num_labels use_hf hub_token model_id_or_path
dataset val_dataset cached_dataset split_dataset_ratio data_seed dataset_num_proc
load_from_cache_file dataset_shuffle streaming shuffle_buffer_size columns custom_dataset_info
interleave_prob strict template template_backend system max_length truncation_strategy
max_pixels agent_template padding_side padding_free loss_scale sequence_parallel_size packing
packing_length packing_strategy lazy_tokenize model_name model_author custom_train_dataset_path
custom_val_dataset_path
tuner_type train_type sft_type tuner_backend target_modules target_regex modules_to_save
lora_rank lora_alpha lora_dropout lora_bias lora_dtype use_dora use_rslora init_weights
adapters lora_target_modules lora_dropout_p lorap_lr_ratio use_galore lisa_activated_layers
neftune_noise_alpha freeze_llm freeze_vit freeze_aligner freeze_parameters
freeze_parameters_ratio trainable_parameters vit_lr aligner_lr quant_method quant_bits
bnb_4bit_quant_type bnb_4bit_use_double_quant
output_dir num_train_epochs max_steps per_device_train_batch_size per_device_eval_batch_size
gradient_accumulation_steps learning_rate lr_scheduler_type warmup_ratio warmup_steps
weight_decay adam_beta1 adam_beta2 adam_epsilon max_grad_norm gradient_checkpointing
gradient_checkpointing_kwargs deepspeed fsdp save_steps save_strategy eval_strategy eval_steps
save_total_limit logging_steps report_to dataloader_num_workers seed bf16 fp16
use_liger_kernel optimizer optim loss_type eval_metric acc_strategy callbacks
resume_from_checkpoint resume_only_model ignore_data_skip save_only_model add_version
check_model create_checkpoint_symlink early_stop_interval predict_with_generate
metric_for_best_model greater_is_better ddp_backend ddp_find_unused_parameters
router_aux_loss_coef enable_dft_loss enable_channel_loss external_plugins
zero_hpz_partition_size deepspeed_autotp_size use_ray
rlhf_type ref_model beta max_completion_length num_generations reward_funcs reward_weights
use_vllm vllm_mode vllm_gpu_memory_utilization vllm_tensor_parallel_size vllm_max_model_len
sleep_level offload_model offload_optimizer temperature loss_weights rpo_alpha label_smoothing
simpo_gamma cpo_alpha desirable_weight undesirable_weight lmbda seq_kd teacher_model
teacher_model_server sft_alpha center_rewards_coefficient ld_alpha discopop_tau
epsilon epsilon_high dynamic_sample max_resample_times scale_rewards advantage_estimator
importance_sampling_level steps_per_generation async_generate gkd_logits_topk
infer_backend max_batch_size result_path write_batch_size stream max_new_tokens top_k top_p
repetition_penalty num_beams stop_words logprobs merge_lora load_args load_data_args ckpt_dir
host port api_key served_model_name ssl_keyfile ssl_certfile
eval_backend eval_dataset eval_limit eval_output_dir eval_num_proc eval_url eval_use_evalscope
quant_n_samples quant_batch_size group_size max_shard_size to_ollama to_mcore to_hf
to_cached_dataset to_peft_format push_to_hub hub_model_id safe_serialization exist_ok
""".split()  # noqa: SIM905 (a word list reads better than 220 quoted names)

# Values shown for each value rule: what each becomes, or the error it gives.
RULE_EXAMPLES = {
    "bf16": ["true", "false"],
    "fp16": ["true"],
    "loss_scale": ["default", "last_round", "all", "react"],
    "attn_impl": ["flash_attn", "flash_attention_2"],
    "infer_backend": ["transformers", "vllm", "lmdeploy"],
    "use_vllm": ["true"],
    "vllm_mode": ["colocate", "server"],
    "use_hf": ["true", "false"],
    "dataset_shuffle": ["true", "false"],
    "check_model": ["false"],
    "dataloader_num_workers": ["4"],
    "lazy_tokenize": ["true"],
    "gradient_checkpointing_kwargs": ["'{\"use_reentrant\": false}'"],
    "ddp_find_unused_parameters": ["false"],
}
COMMANDS = {
    "sft": TrainConfig,
    "pt": TrainConfig,
    "rlhf": RLHFConfig,
    "infer": InferConfig,
    "export": ExportConfig,
    "deploy": DeployConfig,
    "eval": EvalConfig,
}


def swiftlm_flags() -> dict[str, list[str]]:
    """Flag -> the swiftlm commands that take it."""
    owners: dict[str, list[str]] = {}
    for command, config_cls in COMMANDS.items():
        for flag in sorted(set(flag_owners(config_cls)) - UNUSED_FLAGS[command]):
            owners.setdefault(flag, []).append(command)
    return owners


def rule_outcome(name: str, value: str) -> str:
    value = value.strip("'")
    try:
        mapped, note = VALUE_RULES[name](name, value)
    except ConfigError as exc:
        return f"error: {exc}"
    shown = " ".join(f"`--{key} {val}`" for key, val in mapped.items())
    return shown or "accepted, no effect: " + note.removeprefix(f"--{name} {value}: ")


def classify(flag: str, own: dict[str, list[str]]) -> tuple[str, str]:
    if flag in own and flag not in VALUE_RULES:
        return "same", ", ".join(own[flag])
    if flag in RENAMED:
        return "renamed", f"`--{RENAMED[flag]}`"
    if flag == "use_dora":
        return (
            "value",
            "`--use_dora true` is `--train_type dora` (with or without `--train_type lora`)",
        )
    if flag in VALUE_RULES:
        return "value", "; ".join(
            f"`--{flag} {v}` → {rule_outcome(flag, v)}" for v in RULE_EXAMPLES[flag]
        )
    if flag in UNSUPPORTED:
        return "unsupported", UNSUPPORTED[flag]
    return "missing", ""


def render() -> str:
    own = swiftlm_flags()
    rows = {flag: classify(flag, own) for flag in sorted(set(MS_SWIFT_FLAGS))}
    missing = [flag for flag, (kind, _) in rows.items() if kind == "missing"]
    if missing:
        raise SystemExit(f"ms-swift flags in no table: {', '.join(missing)}")
    counts = {
        kind: sum(1 for k, _ in rows.values() if k == kind)
        for kind in ("same", "renamed", "value", "unsupported")
    }
    lines = [
        "# ms-swift flags in swiftlm",
        "",
        "Generated by `python scripts/ms_swift_table.py` from `src/swiftlm/config/ms_swift.py`;",
        "a test keeps it current. An ms-swift command line or YAML file runs under `swiftlm` when",
        "its flags are in the first three groups; a flag of the fourth is an error that says why",
        "and what to use instead. Every rewritten value prints one `ms-swift flag ...` line.",
        "",
        f"{len(rows)} ms-swift flags: {counts['same']} with the same name and meaning, "
        f"{counts['renamed']} renamed, {counts['value']} mapped by value, "
        f"{counts['unsupported']} not supported.",
        "",
    ]
    titles = {
        "same": ("Same name", "swiftlm commands"),
        "renamed": ("Renamed (accepted as typed)", "swiftlm flag"),
        "value": ("Mapped by value (accepted, with a note)", "what it becomes"),
        "unsupported": ("Not supported (an error with this reason)", "reason and what to use"),
    }
    for kind, (title, column) in titles.items():
        lines += [f"## {title}", "", f"| ms-swift flag | {column} |", "|---|---|"]
        lines += [
            f"| `--{flag}` | {text.replace('|', '&#124;')} |"
            for flag, (k, text) in rows.items()
            if k == kind
        ]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    return write_or_check(PAGE, render(), argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
