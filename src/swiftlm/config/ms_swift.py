"""ms-swift's spellings of the common flags, so that an ms-swift command line or YAML file runs.

Three tables, each entry an ms-swift 2.x/3.x/4.x flag that is not a swiftlm flag:
- `RENAMED`: the same knob under another name (`--tuner_type lora` is `--train_type lora`);
- `VALUE_RULES`: a flag whose value maps onto swiftlm flags (`--bf16 true` is
  `--torch_dtype bfloat16`), or that swiftlm does not need at all (`--dataloader_num_workers`);
  every such flag prints a note saying what it became, so nothing changes without a word;
- `UNSUPPORTED`: a flag swiftlm does not have, with the reason and what to do instead; giving
  one is an error (`parse.py` asks `unsupported_hint` before suggesting the nearest flag).

`docs/ms-swift-flags.md` is generated from these tables (`scripts/ms_swift_table.py`) and a
test keeps every entry true: no name here is a swiftlm flag, every target is one.
"""

import os
import sys
from collections.abc import Callable

from swiftlm.errors import ConfigError

RENAMED = {
    "tuner_type": "train_type",  # 4.x
    "sft_type": "train_type",  # 2.x
    "model_id_or_path": "model",  # 2.x
    "lora_target_modules": "target_modules",  # 2.x
    "lora_dropout_p": "lora_dropout",  # 2.x
    "custom_train_dataset_path": "dataset",  # 2.x
    "custom_val_dataset_path": "val_dataset",  # 2.x
    "vllm_max_model_len": "max_model_len",
}

TRUE_WORDS = {"true", "1", "yes"}
FALSE_WORDS = {"false", "0", "no"}


def _flag_bool(name: str, value: str) -> bool:
    word = value.strip().lower()
    if word in TRUE_WORDS | FALSE_WORDS:
        return word in TRUE_WORDS
    raise ConfigError(f"--{name} {value}: expected true or false")


def _dtype(dtype: str) -> Callable[[str, str], tuple[dict[str, str], str]]:
    def rule(name: str, value: str) -> tuple[dict[str, str], str]:
        if not _flag_bool(name, value):
            raise ConfigError(
                f"--{name} false: swiftlm sets the precision with one flag; give "
                "--torch_dtype float32 (or bfloat16/float16) instead"
            )
        return {"torch_dtype": dtype}, f"--{name} true is --torch_dtype {dtype}"

    return rule


def _loss_scale(name: str, value: str) -> tuple[dict[str, str], str]:
    scopes = {"default": "assistant", "last_round": "last_turn", "all": "all"}
    if value not in scopes:
        raise ConfigError(
            f"--loss_scale {value} is not supported: swiftlm trains on "
            "--loss_scope assistant|last_turn|all (ms-swift's default|last_round|all); "
            "agent-specific weightings (react, hermes, ...) are not available"
        )
    return {"loss_scope": scopes[value]}, f"--loss_scale {value} is --loss_scope {scopes[value]}"


def _attn_impl(name: str, value: str) -> tuple[dict[str, str], str]:
    if value in ("sdpa", "eager"):
        return {"attn_impl": value}, ""
    if value.startswith("flash"):
        return {"attn_impl": "sdpa"}, (
            f"--attn_impl {value} is --attn_impl sdpa (PyTorch's scaled-dot-product attention "
            "runs FlashAttention kernels on CUDA; packing works with it, no flash-attn package)"
        )
    raise ConfigError(f"--attn_impl {value}: choose sdpa or eager")


def _infer_backend(name: str, value: str) -> tuple[dict[str, str], str]:
    """ms-swift's spellings of swiftlm's own --infer_backend; its values pass unchanged (the
    command's parser checks them, or says the command takes no --infer_backend)."""
    if value == "transformers":  # ms-swift 4's name for pt
        return {"infer_backend": "pt"}, "--infer_backend transformers is --infer_backend pt"
    if value == "lmdeploy":
        raise ConfigError(
            "--infer_backend lmdeploy is not supported: choose pt (swiftlm's own engine) or vllm"
        )
    return {"infer_backend": value}, ""


def _use_vllm(name: str, value: str) -> tuple[dict[str, str], str]:
    if not _flag_bool(name, value):
        return {}, "--use_vllm false: swiftlm's own engine (--infer_backend pt) is the default"
    return {"infer_backend": "vllm"}, "--use_vllm true is --infer_backend vllm"


def _use_hf(name: str, value: str) -> tuple[dict[str, str], str]:
    if _flag_bool(name, value):
        return {}, "--use_hf true: swiftlm loads hub models from the Hugging Face Hub already"
    raise ConfigError(
        "--use_hf false (the ModelScope hub) is not supported: download the model "
        "(`modelscope download --model ID --local_dir DIR`) and give --model DIR"
    )


def _dataset_shuffle(name: str, value: str) -> tuple[dict[str, str], str]:
    if _flag_bool(name, value):
        return {}, "--dataset_shuffle true: swiftlm shuffles every epoch (seeded by --data_seed)"
    raise ConfigError(
        "--dataset_shuffle false is not supported: swiftlm shuffles the training data every "
        "epoch, seeded by --data_seed; drop the flag"
    )


def _not_needed(reason: str) -> Callable[[str, str], tuple[dict[str, str], str]]:
    def rule(name: str, value: str) -> tuple[dict[str, str], str]:
        return {}, f"--{name} {value}: not needed by swiftlm ({reason}); ignored"

    return rule


VALUE_RULES: dict[str, Callable[[str, str], tuple[dict[str, str], str]]] = {
    "bf16": _dtype("bfloat16"),
    "fp16": _dtype("float16"),
    "loss_scale": _loss_scale,
    "attn_impl": _attn_impl,  # ms-swift's flash_attn spellings; swiftlm's own values pass
    "infer_backend": _infer_backend,
    "use_vllm": _use_vllm,  # GRPO's rollouts
    "use_hf": _use_hf,
    "dataset_shuffle": _dataset_shuffle,
    "check_model": _not_needed("it never contacts a hub to check a local model"),
    "dataloader_num_workers": _not_needed(
        "batches are cut from memory-mapped tokenized data, the next ones prepared in a thread"
    ),
    "lazy_tokenize": _not_needed("data is tokenized once into a cache reused by later runs"),
    "gradient_checkpointing_kwargs": _not_needed("checkpointing is always non-reentrant"),
    "ddp_find_unused_parameters": _not_needed(
        "DDP looks for unused parameters exactly when parts of the model may not run"
    ),
}

_MEGATRON = "swiftlm's --tensor_parallel_size and --pipeline_parallel_size cover TP and PP"
_VLLM = "vLLM's memory is not released between GRPO's generations yet; drop the flag"
UNSUPPORTED = {
    # model
    "model_type": "swiftlm reads the architecture from the model's config.json; drop the flag",
    "model_revision": "download the revision and give its folder as --model",
    "task_type": "sft trains causal LMs; reward models are `swiftlm rlhf --rlhf_type rm`",
    "device_map": "use --strategy fsdp2/tp/pp (or --deepspeed) to spread a model over devices",
    "max_memory": "use `swiftlm plan` to see what fits, then --strategy",
    "rope_scaling": "set it in the model's config.json",
    "new_special_tokens": "add them to the tokenizer and save it with the model",
    "num_labels": "reward models (`rlhf --rlhf_type rm`) have one output",
    "hub_token": "set HF_TOKEN in the environment",
    "tuner_backend": "swiftlm's tuners are peft's (--train_type lora, dora, vera, loha, ...)",
    # data and template
    "columns": "rename the columns in the file, or register a dataset format plugin",
    "custom_dataset_info": "give files with --dataset, or register a dataset format plugin",
    "cached_dataset": "swiftlm caches the tokenized data itself (--load_from_cache_file)",
    "interleave_prob": "datasets are concatenated; sample one with `path#N`",
    "strict": "bad rows are always errors; --skip_bad_rows skips them with counts",
    "template": "swiftlm renders with the tokenizer's own chat template; replace it for a "
    "model type with a chat-template plugin (docs/plugins.md)",
    "template_backend": "swiftlm renders with the tokenizer's own chat template",
    "agent_template": "tool calls follow the model's chat template (serve: hermes parser)",
    "padding_side": "training pads on the right; the engine needs no padding",
    "packing_length": "packed rows are --max_length long",
    "packing_strategy": "packing is best-fit decreasing",
    # tuners and optimizer
    "target_regex": "give module name suffixes with --target_modules",
    "lora_bias": "LoRA adapters have no bias",
    "lora_dtype": "adapters train in the model's --torch_dtype",
    "use_galore": "use --optim galore_adamw (--optim_args rank=...,update_proj_gap=..., "
    "--optim_target_modules)",
    "neftune_noise_alpha": "NEFTune is not available",
    "optimizer": "give transformers' optimizer name with --optim (adamw_torch, adafactor, "
    "muon, galore_adamw, ...)",
    "vit_lr": "the vision tower trains at --learning_rate (or stays frozen: --freeze_vit)",
    "aligner_lr": "the aligner trains at --learning_rate (or stays frozen: --freeze_aligner)",
    "trainable_parameters": "train all with --train_type full and freeze with --freeze_parameters",
    "freeze_parameters_ratio": "give prefixes with --freeze_parameters",
    "warmup_steps": "give the warmup as a share of the steps with --warmup_ratio",
    "enable_dft_loss": "not available",
    "enable_channel_loss": "not available",
    # schedule, checkpoints, evaluation
    "save_strategy": "swiftlm saves every --save_steps and at the end",
    "eval_strategy": "swiftlm evaluates every --eval_steps (default --save_steps) and at the end",
    "save_only_model": "checkpoints always hold what an exact resume needs; final/ is the model",
    "resume_only_model": "--resume_from_checkpoint resumes exactly; to start anew from weights "
    "give the checkpoint as --model",
    "ignore_data_skip": "a resumed run continues at the exact sample where it stopped",
    "create_checkpoint_symlink": "`--resume_from_checkpoint auto` finds the newest checkpoint",
    "early_stop_interval": "not available; --metric_for_best_model keeps the best checkpoint",
    "predict_with_generate": "evaluate generations with `swiftlm eval`",
    "eval_metric": "use `swiftlm eval --task ...` for task metrics",
    "acc_strategy": "token accuracy is logged as computed over trained tokens",
    "callbacks": "write a callback plugin (docs/plugins.md) and pass it with --external_plugins",
    "eval_use_evalscope": "use `swiftlm eval` after training",
    "ddp_backend": "swiftlm uses nccl on CUDA and gloo on CPU",
    # distributed
    "zero_hpz_partition_size": "ZeRO++ is not available",
    "deepspeed_autotp_size": "use --tensor_parallel_size",
    "use_ray": "launch with --nnodes/--rdzv_endpoint (torchrun's elastic agent)",
    "sleep_level": _VLLM,
    "offload_model": _VLLM,
    "offload_optimizer": "use --deepspeed zero2_offload/zero3_offload or --fsdp_offload",
    "teacher_model_server": "give the teacher as --teacher_model",
    "sft_alpha": "not available for gkd",
    "center_rewards_coefficient": "not available for rm",
    "ld_alpha": "not available for dpo",
    "discopop_tau": "not available for dpo",
    # inference, export, hub
    "num_beams": "generation samples or decodes greedily (--temperature 0)",
    "stop_words": "the chat template's end-of-turn token stops generation; the server takes "
    "`stop` per request",
    "logprobs": "ask the server for logprobs per request",
    "write_batch_size": "results are written as they finish",
    "load_args": "infer/export read the run's config.yaml whenever --model is a run",
    "load_data_args": "give --val_dataset",
    "push_to_hub": "upload final/ with `huggingface-cli upload`",
    "hub_model_id": "upload final/ with `huggingface-cli upload`",
    "to_mcore": _MEGATRON,
    "to_hf": _MEGATRON,
    "to_cached_dataset": "swiftlm caches tokenized data on the first run",
    "to_peft_format": "adapters are saved in peft's format already",
    "safe_serialization": "weights are always safetensors",
    "exist_ok": "use --overwrite_output_dir",
    "quant_batch_size": "calibration runs one sample at a time",
    "ssl_keyfile": "put the server behind a TLS-terminating proxy",
    "ssl_certfile": "put the server behind a TLS-terminating proxy",
    "eval_num_proc": "requests are batched by the engine (--max_num_seqs)",
}


def unsupported_hint(name: str) -> str | None:
    """The error text for an ms-swift flag swiftlm does not support, or None."""
    reason = UNSUPPORTED.get(name)
    if reason is None:
        return None
    return f"--{name} is an ms-swift flag that swiftlm does not support: {reason}"


def _is_flag(token: str) -> bool:
    return token.startswith("--") and len(token) > 2


def _split(argv: list[str]) -> list[tuple[str | None, list[str]]]:
    """[(flag name or None, its values)]; `--flag=value` counts as one value."""
    groups: list[tuple[str | None, list[str]]] = []
    for arg in argv:
        if _is_flag(arg):
            name, eq, value = arg[2:].partition("=")
            groups.append((name, [value] if eq else []))
        elif groups:
            groups[-1][1].append(arg)
        else:
            groups.append((None, [arg]))
    return groups


def _one_value(name: str, value) -> str:
    """A flag's single value, from a command line (a list of tokens) or YAML (a scalar)."""
    if isinstance(value, list):
        if len(value) != 1:
            raise ConfigError(f"--{name} takes one value (got {len(value)})")
        value = value[0]
    return str(value).lower() if isinstance(value, bool) else str(value)


def _dora(train_type: str | None) -> str:
    """The --train_type that `--use_dora true` makes of the one given (None: not given)."""
    if train_type not in (None, "lora", "dora"):
        raise ConfigError(f"--use_dora true needs LoRA, not --train_type {train_type}")
    return "dora"


def translate(flags: list[tuple[str, object]]) -> tuple[list[tuple[str, object]], list[str]]:
    """(name, value) pairs with ms-swift's value flags rewritten into swiftlm flags, and the
    notes saying what each rule did. Names are already normalized (RENAMED applied); a value
    is a command line's token list or a YAML scalar, and rewritten ones are strings."""
    out: list[tuple[str, object]] = []
    notes: list[str] = []
    use_dora = False
    for name, value in flags:
        if name == "use_dora":
            use_dora = _flag_bool(name, _one_value(name, value) if value != [] else "true")
        elif name in VALUE_RULES:
            mapped, note = VALUE_RULES[name](name, _one_value(name, value))
            out += list(mapped.items())
            notes += [note] if note else []
        else:
            out.append((name, value))
    if use_dora:
        given = [i for i, (name, _) in enumerate(out) if name == "train_type"]
        for i in given:
            out[i] = ("train_type", _dora(_one_value("train_type", out[i][1])))
        out += [] if given else [("train_type", _dora(None))]
        notes.append("--use_dora true is --train_type dora")
    return out, notes


def translate_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """A normalized command line with ms-swift's value flags rewritten (see `translate`)."""
    groups = _split(argv)
    head = [arg for name, values in groups if name is None for arg in values]
    translated, notes = translate([(name, values) for name, values in groups if name])
    tokens = [
        token
        for name, value in translated
        for token in (f"--{name}", *(value if isinstance(value, list) else [value]))
    ]
    return head + tokens, notes


def translate_mapping(data: dict) -> tuple[dict, list[str]]:
    """The same for the top-level keys of a YAML config."""
    translated, notes = translate(list(data.items()))
    out: dict = {}
    for key, value in translated:
        if key in out:
            raise ConfigError(f"'{key}' is given twice (once through an ms-swift key); keep one")
        out[key] = value
    return out, notes


def print_notes(notes: list[str], prog: str) -> None:
    """One line per note, on rank 0 only (torchrun workers parse the same flags again)."""
    if os.environ.get("RANK", "0") != "0":
        return
    for note in notes:
        print(f"{prog}: ms-swift flag {note}", file=sys.stderr, flush=True)
