"""A resumed run continues the run that saved its checkpoint, so the flags that give the
checkpoint its meaning must not change. Checked before anything loads, against the saved
config.yaml of that run:

- MUST_MATCH: the model and tuner shape the saved weights belong to; the data, batching and
  seed that the saved data position counts micro-batches of; the optimizer settings and the
  schedule's shape; the objective of `swiftlm rlhf` (method, beta, loss type and weights).
  The batch is compared as the global batch, the rows of an optimizer step (`elastic`): a
  run may resume on another number of processes with the same rows per step (2 ranks x 2
  rows x 1 accumulation = 1 x 4 x 1 = 1 x 2 x 2); the data position is converted
  (`state.resume`). An elastic job (--nnodes MIN:MAX) keeps it by itself: its gradient
  accumulation follows the ranks (`resolve`). The optimizer's saved state brings back its
  learning rate, betas, eps and weight decay (`Optimizer.load_state_dict`), and the schedule
  its base learning rate, so a new value there would be silently ignored. Any difference is a ConfigError naming each
  `--flag: saved X, now Y`.
- The run's length (--max_steps / --num_train_epochs) may change, to extend a run: the
  schedule is rebuilt for the new length from the checkpoint's step on (`state.resume` sets
  the learning rate it gives there), and the log says so. A --max_steps below the
  checkpoint's step is refused.
- Everything else (logging, saving, evaluation, clipping, dropout, precision, engines) may
  change.
"""

import dataclasses
import json
from pathlib import Path

import yaml

from swiftlm.checkpoint import STATE_FILE
from swiftlm.checkpoint.targets import RUN_CONFIG, find_resume_checkpoint, run_dir_of
from swiftlm.config import TrainConfig
from swiftlm.config.checks import flag_values
from swiftlm.errors import ConfigError
from swiftlm.train.config import AUTO_BATCH_SIZE
from swiftlm.train.elastic import GLOBAL_BATCH, data_parallel, planned_world, shape_of


def _always(cfg: TrainConfig) -> bool:
    return True


def _adapters(cfg: TrainConfig) -> bool:
    """The LoRA flags shape nothing in a full fine-tune."""
    return cfg.tuner.train_type != "full"


def _builtin_data(cfg: TrainConfig) -> bool:
    """--model_name and --model_author fill in the built-in self-cognition rows only."""
    return any(spec.startswith("swiftlm/") for spec in cfg.data.dataset)


def _token_budget(cfg: TrainConfig) -> bool:
    """Only the micro-batches of a token budget depend on --padding_free (their cost)."""
    return cfg.train.max_tokens_per_batch > 0


# Flag -> when it must match (given this run's config).
MUST_MATCH = {
    # The weights in the checkpoint: the model, and the tuner's shape.
    "model": _always,
    "train_type": _always,
    "lora_rank": _adapters,
    "lora_alpha": _adapters,
    "target_modules": _adapters,
    "use_rslora": _adapters,
    "modules_to_save": _adapters,
    "init_weights": _adapters,  # PiSSA/OLoRA: the residual base the adapter was trained on
    "lorap_lr_ratio": _adapters,  # the optimizer's param groups
    "lisa_activated_layers": _always,  # which layers each step trains
    "lisa_step_interval": _always,
    "quant_method": _always,
    "quant_bits": _always,
    "bnb_4bit_quant_type": _always,
    "bnb_4bit_use_double_quant": _always,
    # The samples and their order: the checkpoint's data position counts micro-batches.
    "model_name": _builtin_data,
    "model_author": _builtin_data,
    "dataset": _always,
    "split_dataset_ratio": _always,
    "max_length": _always,
    "truncation_strategy": _always,
    "system": _always,
    "loss_scope": _always,
    "data_seed": _always,
    "seed": _always,
    "packing": _always,
    "max_tokens_per_batch": _always,
    "padding_free": _token_budget,
    # What the optimizer state restores, and the schedule's shape.
    "optim": _always,
    "optim_args": _always,
    "optim_target_modules": _always,
    "learning_rate": _always,
    "lr_scheduler_type": _always,
    "warmup_ratio": _always,
    "weight_decay": _always,
    "adam_beta1": _always,
    "adam_beta2": _always,
    "adam_epsilon": _always,
    # The objective (swiftlm rlhf): a resumed run continues the same optimization.
    "rlhf_type": _always,
    "beta": _always,
    "loss_type": _always,
    "label_smoothing": _always,
    "rpo_alpha": _always,
    "simpo_gamma": _always,
    "cpo_alpha": _always,
    "loss_weights": _always,
    "ref_model": _always,  # --precompute_ref_log_probs gives the same losses: it may change
    "desirable_weight": _always,
    "undesirable_weight": _always,
    # GRPO: what is sampled, how it is scored, and the pending completions' layout.
    **dict.fromkeys(
        (
            "num_generations",
            "max_completion_length",
            "temperature",
            "top_p",
            "epsilon",
            "epsilon_high",
            "importance_sampling_level",
            "scale_rewards",
            "advantage_estimator",
            "dynamic_sample",
            "max_resample_times",
            "steps_per_generation",
            "reward_funcs",
            "reward_weights",
            "format_pattern",
            "soft_cache_length",
            "repetition_n_grams",
            # GKD: the teacher and the mix of on- and off-policy steps.
            "teacher_model",
            "lmbda",
            "seq_kd",
            "gkd_logits_topk",
        ),
        _always,
    ),
}


def check_resume_matches(cfg: TrainConfig, world_size: int, log) -> None:
    """Refuse a resume whose flags differ from the saved run's where it matters; state a new
    run length. `cfg` is resolved (`resolve.resolve_defaults`) and its run directory settled;
    `world_size`: the processes of this run."""
    spec = cfg.output.resume_from_checkpoint
    checkpoint, _ = find_resume_checkpoint(Path(cfg.output.output_dir or "."), spec)
    if checkpoint is None:
        return  # `auto` with nothing to resume: the run starts from scratch (state.resume)
    run = run_dir_of(checkpoint)
    saved_file = run / RUN_CONFIG if run is not None else None
    if saved_file is None or not saved_file.is_file():
        log(
            f"--resume_from_checkpoint {spec}: {checkpoint} has no config.yaml of its run beside "
            "it, so its settings are not compared with this run's"
        )
        return
    saved, state = _saved_flags(saved_file), _trainer_state(checkpoint)
    saved_ranks = data_parallel(saved, state.get("world_size", world_size))
    now_ranks = data_parallel(cfg, planned_world(cfg, world_size))
    changed = differences(saved, cfg, (saved_ranks, now_ranks), state.get(GLOBAL_BATCH))
    if changed:
        raise ConfigError(
            f"--resume_from_checkpoint {spec}: {checkpoint} was saved by a run with other "
            "settings, which its weights, optimizer state and data position belong to:\n  "
            + "\n  ".join(changed)
            + f"\nrerun with the saved values (in {saved_file}), or start a new run in a new "
            "--output_dir"
        )
    _check_run_length(saved, cfg, checkpoint, state.get("step", 0), log)


def differences(
    saved: dict, cfg: TrainConfig, ranks: tuple[int, int] = (1, 1), saved_global: int | None = None
) -> list[str]:
    """`--flag: saved X, now Y` for each MUST_MATCH flag that differs, in flag order, then the
    global batch (`ranks`: the data-parallel ranks of the saved run and of this one;
    `saved_global`: the checkpoint's record of it, else computed from the saved flags). A
    flag missing from the saved config (written by an older swiftlm) is not compared."""
    lines = []
    for flag, value in flag_values(cfg).items():
        matters = MUST_MATCH.get(flag)
        if matters is None or not matters(cfg) or flag not in saved:
            continue
        if saved[flag] != value:
            lines.append(f"--{flag}: saved {_shown(saved[flag])}, now {_shown(value)}")
    batch = _global_batch_difference(saved, cfg, ranks, saved_global)
    return lines + ([batch] if batch else [])


def _global_batch_difference(
    saved: dict, cfg: TrainConfig, ranks: tuple[int, int], saved_global: int | None
) -> str | None:
    """The saved data position and optimizer state belong to steps of one global batch (rows,
    or with a token budget budget micro-batches, per step: `elastic`). The ranks may change
    when the batch size or gradient accumulation makes up for it: 2 ranks x 2 rows x 1 step
    = 1 rank x 2 rows x 2 steps."""
    now = shape_of(flag_values(cfg), 1)
    now = dataclasses.replace(now, ranks=ranks[1])
    if saved_global is None:
        if "per_device_train_batch_size" not in saved:
            return None  # written by an older swiftlm
        before = shape_of(saved, 1)
        saved_global = dataclasses.replace(before, ranks=ranks[0]).size
    if cfg.train.per_device_train_batch_size == AUTO_BATCH_SIZE and not now.budget:
        return None  # auto reuses the saved size (resolve.py)
    if saved_global == now.size:
        return None
    unit = "budget micro-batches" if now.budget else "rows"
    per_micro_batch = now.per_rank * now.ranks
    hint = ""
    if saved_global % per_micro_batch == 0:
        hint = f"; --gradient_accumulation_steps {saved_global // per_micro_batch} keeps it"
    return f"global batch: saved {saved_global} {unit} per step, now {now}{hint}"


def _saved_flags(path: Path) -> dict:
    """Flag -> value of a saved config.yaml (grouped by section, as `save_config` writes it)."""
    sections = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return {
        key: value
        for section in sections.values()
        if isinstance(section, dict)
        for key, value in section.items()
    }


def _shown(value) -> str:
    """A value as it is typed on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return " ".join(map(str, value))
    return "unset" if value is None else str(value)


def _run_length(flags: dict) -> str:
    """The flag that sets a run's length: --max_steps when positive, else the epochs."""
    if (flags.get("max_steps") or 0) > 0:
        return f"--max_steps {flags['max_steps']}"
    return f"--num_train_epochs {flags.get('num_train_epochs')}"


def _trainer_state(checkpoint: Path) -> dict:
    """The checkpoint's step and world size, among others (a complete checkpoint has it)."""
    state = checkpoint / STATE_FILE
    return json.loads(state.read_text()) if state.is_file() else {}


def _check_run_length(saved: dict, cfg: TrainConfig, checkpoint: Path, step: int, log) -> None:
    max_steps = cfg.train.max_steps
    if 0 < max_steps < step:
        raise ConfigError(
            f"--max_steps {max_steps}: the checkpoint {checkpoint} is at step {step} already; "
            f"pass a --max_steps above {step} to train further, or start a new run in a new "
            "--output_dir"
        )
    before, now = _run_length(saved), _run_length(flag_values(cfg))
    if before != now:
        log(
            f"resuming with {now} (the checkpoint was saved by a run with {before}): training "
            f"continues from step {step} on a learning-rate schedule rebuilt for the new length"
        )
