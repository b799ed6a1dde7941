"""What the loop evaluates every --eval_steps, and which checkpoint is the best so far.

Two kinds of evaluation, logged on one metrics.jsonl line:
- the validation loss (`eval_loss`, the method's own loss on --val_dataset, every rank);
- generation tasks (`--eval_dataset`, the tasks of `swiftlm eval`, run by
  `swiftlm.evaluation.live`): rank 0 runs them on the live model and sends the scores to the
  other ranks, logged as `eval/<task>/<metric>`. The tasks' rows are read and validated
  before step 1, like the training data.

`--metric_for_best_model` names one logged value; the checkpoint saved at the step with its
best value is kept by --save_total_limit and named in best_checkpoint.json.
"""

import json
import math
from pathlib import Path

from swiftlm.checkpoint import checkpoint_dir
from swiftlm.errors import ConfigError
from swiftlm.evaluation.config import TrainEvalArguments
from swiftlm.evaluation.live import LiveEvaluator, load_training_tasks
from swiftlm.methods.reference import unwrapped
from swiftlm.models.loader import CAUSAL_LM

BEST_CHECKPOINT = "best_checkpoint.json"


class GenerationEvaluator:
    """--eval_dataset's tasks, run on the model being trained (its unwrapped module)."""

    def __init__(self, live: LiveEvaluator):
        self.live = live

    def evaluate(self, model) -> dict[str, float]:
        return self.live.evaluate(unwrapped(model))

    def evaluate_on_ranks(self, model, ctx) -> dict[str, float]:
        """Rank 0 evaluates; every rank returns its scores (to log and to pick the best)."""
        values = self.evaluate(model) if ctx.is_main else None
        return ctx.broadcast_object(values)

    def close(self) -> None:
        self.live.close()


def whole_model_on_each_rank(strategy) -> bool:
    """One process or DDP: rank 0 holds the whole model and can generate alone. FSDP2, tensor,
    sequence and pipeline parallel and DeepSpeed need every rank in each forward pass."""
    dims = getattr(strategy, "dims", None)
    return dims is not None and not dims.sharded and dims.pp == 1 and dims.sp == 1


def build_generation_evaluator(cfg, tokenizer, strategy, method) -> GenerationEvaluator | None:
    """The evaluator of --eval_dataset (tasks loaded and checked now), or None without one."""
    settings: TrainEvalArguments = cfg.evaluation
    if not settings.eval_dataset:
        return None
    if method.model_kind != CAUSAL_LM:
        raise ConfigError(
            f"--eval_dataset: {method.name} trains a score head, which generates no text; its "
            "validation is eval_loss and eval_rewards/accuracies on --val_dataset"
        )
    if not whole_model_on_each_rank(strategy):
        raise ConfigError(
            f"--eval_dataset during training runs on one process or DDP; this run ({strategy}) "
            "splits the model (or its sequences) over ranks. Evaluate its checkpoints with `swiftlm eval "
            "--ckpt_dir RUN/checkpoints/step-N` instead"
        )
    placeholders = {"{{NAME}}": cfg.model.model_name, "{{AUTHOR}}": cfg.model.model_author}
    tasks = load_training_tasks(settings.eval_dataset, settings.eval_limit, placeholders)
    max_new_tokens = settings.eval_max_new_tokens
    max_model_len = cfg.data.max_length + max_new_tokens
    live = LiveEvaluator(tasks, tokenizer, max_model_len, max_new_tokens, cfg.train.seed)
    return GenerationEvaluator(live)


class BestCheckpoint:
    """The best value of --metric_for_best_model so far, and the step that had it."""

    def __init__(self, settings: TrainEvalArguments):
        self.metric = settings.metric_for_best_model
        self.higher = settings.higher_is_better

    def update(self, state, evaluated: dict[str, float]) -> None:
        if not self.metric:
            return
        if self.metric not in evaluated:
            raise ConfigError(
                f"--metric_for_best_model {self.metric}: not among the evaluated values "
                f"({', '.join(sorted(evaluated))}); name one of them"
            )
        value = evaluated[self.metric]
        if not math.isfinite(value):
            return
        best = state.best_metric
        if best is None or (value > best if self.higher else value < best):
            state.best_metric, state.best_step = value, state.step

    def folder(self, run_dir: Path, state) -> Path | None:
        """The best step's checkpoint folder, when that step was saved."""
        if not self.metric or state.best_step is None:
            return None
        folder = checkpoint_dir(run_dir, state.best_step)
        return folder if folder.is_dir() else None

    def write(self, run_dir: Path, state) -> None:
        folder = self.folder(run_dir, state)
        if folder is None:
            return
        record = {
            "metric": self.metric,
            "value": state.best_metric,
            "step": state.best_step,
            "checkpoint": str(folder.relative_to(run_dir)),
            "greater_is_better": self.higher,
        }
        path = run_dir / BEST_CHECKPOINT
        path.with_suffix(".tmp").write_text(json.dumps(record, indent=2) + "\n")
        path.with_suffix(".tmp").replace(path)
