"""Per-step timing hook, loaded by every Python process of a benchmark run.

run.py puts this folder on PYTHONPATH, so Python imports it at start-up in the framework's
process and in any process it spawns (`swift sft` re-launches itself). It does nothing unless
BENCH_STEP_LOG names a file. Then it waits, without importing anything heavy, for the module
that holds the training loop to be imported, and wraps it:

- transformers.trainer (ms-swift and TRL both train with the Hugging Face Trainer):
  `Trainer.training_step` counts the micro-batch's label tokens, and a TrainerCallback added
  in `Trainer.__init__` writes one line per optimizer step (on_step_end) and one per logged
  loss (on_log);
- swiftlm.train.loop: `forward_backward` counts the step's label tokens and `clip_and_step`
  (the optimizer step) writes the line.

So the frameworks run unchanged, from their own command lines. Lines are JSON:
  {"event": "step", "step": n, "time": unix_seconds, "label_tokens": k}
  {"event": "loss", "step": n, "loss": x}
Label tokens are counted the same way everywhere: labels[:, 1:] != -100 (the tokens that are
predicted after the causal shift), from the batch exactly as the framework built it.
"""

import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

LOG_PATH = os.environ.get("BENCH_STEP_LOG")
IGNORE_INDEX = -100


def write(row: dict) -> None:
    # Append + flush per line: the run may be killed, and run.py reads the file afterwards.
    with open(LOG_PATH, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def count_label_tokens(labels) -> int:
    if labels is None:
        return 0
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


class StepCounter:
    """Label tokens seen since the last optimizer step (micro-batches add up)."""

    pending = 0

    @classmethod
    def take(cls) -> int:
        value, cls.pending = cls.pending, 0
        return value


def patch_hf_trainer(module) -> None:
    from transformers import TrainerCallback

    trainer_cls = module.Trainer

    class StepLogger(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            write(
                {
                    "event": "step",
                    "step": state.global_step,
                    "time": time.time(),
                    "label_tokens": StepCounter.take(),
                }
            )

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                write({"event": "loss", "step": state.global_step, "loss": float(logs["loss"])})

    original_init, original_training_step = trainer_cls.__init__, trainer_cls.training_step

    # functools.wraps keeps the signatures visible: ms-swift inspects Trainer.__init__'s
    # parameters to pick `processing_class` over `tokenizer`.
    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.add_callback(StepLogger())

    @functools.wraps(original_training_step)
    def training_step(self, model, inputs, *args, **kwargs):
        # Counted before the step runs: some trainers pop "labels" out of the inputs.
        StepCounter.pending += count_label_tokens(inputs.get("labels"))
        return original_training_step(self, model, inputs, *args, **kwargs)

    trainer_cls.__init__, trainer_cls.training_step = __init__, training_step


def patch_swiftlm_loop(module) -> None:
    missing = [name for name in ("forward_backward", "clip_and_step") if not hasattr(module, name)]
    if missing:
        # A loud, specific failure beats a benchmark row with no timings.
        raise RuntimeError(f"benchmark hook: swiftlm.train.loop has no {', '.join(missing)}")
    original_fb, original_step = module.forward_backward, module.clip_and_step
    state = {"step": 0}

    @functools.wraps(original_fb)
    def forward_backward(job, precision, batches, *args, **kwargs):
        StepCounter.pending += sum(count_label_tokens(b.get("labels")) for b in batches)
        return original_fb(job, precision, batches, *args, **kwargs)

    @functools.wraps(original_step)
    def clip_and_step(job, optimizer, scheduler, precision, loss, loop_state, *args, **kwargs):
        result = original_step(
            job, optimizer, scheduler, precision, loss, loop_state, *args, **kwargs
        )
        state["step"] += 1
        now = time.time()
        write(
            {
                "event": "step",
                "step": state["step"],
                "time": now,
                "label_tokens": StepCounter.take(),
            }
        )
        # clip_and_step takes the step's `StepResult` (its .loss) since the loop's window
        # refactor; a bare float before it
        write({"event": "loss", "step": state["step"], "loss": float(getattr(loss, "loss", loss))})
        return result

    module.forward_backward, module.clip_and_step = forward_backward, clip_and_step


PATCHES = {"transformers.trainer": patch_hf_trainer, "swiftlm.train.loop": patch_swiftlm_loop}


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the target modules through the normal finders, then patches them once loaded."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        original_exec = spec.loader.exec_module

        def exec_module(module):
            original_exec(module)
            PATCHES[fullname](module)

        spec.loader.exec_module = exec_module
        return spec


if LOG_PATH:
    sys.meta_path.insert(0, PatchAfterImport())
