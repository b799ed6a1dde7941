"""What an online method (GRPO, GKD) adds to `methods.base.Method`: it makes its own
micro-batches each step, by sampling from the policy, instead of reading them from the data.

It overrides capabilities of `methods.base.MethodDefaults`: `step_batches(model,
StepContext)` draws prompt micro-batches with `context.draw()` (each call: one optimizer
step's worth, the data position advances) as it needs them instead of returning the data
position's, and may keep completions for later steps: `state_dict()` goes into every
checkpoint (per rank, `has_step_state`) and `load_state_dict()` restores it on resume, so a
resumed run trains on what the straight run would have. `step_metrics()` adds the
generation's figures (rewards, lengths ...) to the log; `evaluate()` scores sampled answers.
"""

from typing import Any

from swiftlm.errors import ConfigError
from swiftlm.methods.base import Batch, Layout, MethodDefaults
from swiftlm.train.config import AUTO_BATCH_SIZE

# Why the engine cannot sample from a sharded model: it runs the whole local module.
SHARDED = "the rollout engine needs the whole model on each rank; use data parallel (ddp)"


def check_online_layout(cfg, method: str, lockstep: bool = False) -> None:
    """Refuse, before anything loads, what an online method (`method`, e.g. "--rlhf_type
    grpo") cannot run: sharded models (but FSDP2 when it samples in `lockstep`), and the
    batch shapes its sampled rows rule out."""
    t, d = cfg.train, cfg.dist
    if t.per_device_train_batch_size == AUTO_BATCH_SIZE:
        raise ConfigError(
            f"--per_device_train_batch_size auto: not available with {method} (a micro-batch "
            "is completions sampled each step); give a number"
        )
    refused = {
        "--fsdp": (bool(d.fsdp) and not lockstep, SHARDED),
        "--deepspeed": (bool(d.deepspeed), SHARDED),
        "--tensor_parallel_size": (d.tensor_parallel_size > 1, SHARDED),
        "--pipeline_parallel_size": (d.pipeline_parallel_size > 1, SHARDED),
        f"--strategy {d.strategy}": (
            d.strategy in ("deepspeed", "tp", "pp") or (d.strategy == "fsdp2" and not lockstep),
            SHARDED,
        ),
        "--packing": (t.packing, "a micro-batch is sampled completions; drop the flag"),
        "--max_tokens_per_batch": (t.max_tokens_per_batch > 0, "drop the flag"),
        "--torch_compile": (t.torch_compile, "the sampled shapes change every step; drop it"),
    }
    for flag, (given, why) in refused.items():
        if given:
            raise ConfigError(f"{flag}: not available with {method} yet: {why}")


def sharded_by_fsdp2(cfg) -> bool:
    """Whether the flags ask for FSDP2 (whose forwards need every rank in lockstep)."""
    return bool(cfg.dist.fsdp) or cfg.dist.strategy == "fsdp2"


class PromptBatches(MethodDefaults):
    """What online methods share about their encoded samples: a prompt (`prompt_ids`) that
    will get up to --max_completion_length sampled tokens, and a `weight` (0: padding)."""

    args: Any  # the method's GRPOArguments (max_completion_length)
    has_step_state = True  # completions sampled for later steps

    def length(self, sample: dict) -> int:
        return len(sample["prompt_ids"]) + self.args.max_completion_length

    @staticmethod
    def masked(sample: dict) -> dict:
        return {**sample, "weight": 0.0}

    @staticmethod
    def collate(layout: Layout) -> Batch:
        """A prompt micro-batch: the encoded samples themselves (the method samples from them
        and makes the tensors in `step_batches`); a packed layout's one row holds them all."""
        return {"prompts": [sample for row in layout.rows for sample in row]}


def prompt_ids(tokenizer, prompt: list[dict], budget: int, strategy: str, report) -> list | None:
    """The prompt's ids (chat template + generation prompt), within `budget` tokens (what
    --max_length leaves after --max_completion_length): a longer prompt is dropped and counted
    (None), or with --truncation_strategy left keeps its last `budget` tokens."""
    ids = tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    if len(ids) <= budget:
        return ids
    if strategy != "left":
        report.counts["deleted"] += 1
        return None
    report.counts["truncated"] += 1
    return ids[-budget:]
