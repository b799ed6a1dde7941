"""Tasks on a live model: `--eval_dataset`'s tasks run on the model being trained.

The tasks are those of `swiftlm eval` (read and validated before step 1, like the training
data), run through the serving engine on the module itself (no copy of the weights), greedy
and seeded. Each metric's mean is one value, `eval/<task>/<metric>`. Judge tasks need a judge
server, which a training run has no flag for. Which rank runs them, and when, is the training
loop's (`train/evaluation.py`).
"""

from swiftlm.engine.continuous import ContinuousEngine, stop_token_ids
from swiftlm.errors import ConfigError
from swiftlm.evaluation.backends import LocalBackend, Sampling
from swiftlm.evaluation.runner import run_task
from swiftlm.evaluation.summary import summarize
from swiftlm.evaluation.task_file import check_not_empty, load_tasks
from swiftlm.evaluation.tasks import EvalSettings, Task

TRAINING_TASK_KINDS = ("generation", "perplexity", "multiple_choice", "code")


def load_training_tasks(
    specs: list[str], limit: int | None, placeholders: dict[str, str]
) -> list[Task]:
    """The tasks of --eval_dataset for a training run: all read and checked now."""
    tasks = load_tasks(specs, limit, placeholders)
    check_not_empty(tasks)
    for task in tasks:
        if task.kind not in TRAINING_TASK_KINDS:
            raise ConfigError(
                f"--eval_dataset {task.source}: {task.kind} tasks are not run during training "
                f"(they need a judge server); use them with `swiftlm eval`"
            )
    return tasks


class LiveEvaluator:
    """Runs `tasks` on a model module in place; the engine is built once per module."""

    def __init__(
        self, tasks: list[Task], tokenizer, max_model_len: int, max_new_tokens: int, seed: int
    ):
        self.tasks = tasks
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.engine: ContinuousEngine | None = None

    def evaluate(self, model) -> dict[str, float]:
        """`eval/<task>/<metric>` -> mean, with dropout off; the model's mode is restored."""
        was_training = model.training
        if self.engine is None or self.engine.model is not model:
            self.engine = ContinuousEngine(
                model,
                self.tokenizer,
                stop_token_ids=stop_token_ids(self.tokenizer, model),
                max_model_len=self.max_model_len,
                seed=self.seed,
            )
        backend = LocalBackend(self.engine, "the model being trained")
        sampling = Sampling(max_new_tokens=self.max_new_tokens, seed=self.seed)
        chat = bool(getattr(self.tokenizer, "chat_template", None))
        values: dict[str, float] = {}
        try:
            model.eval()
            for task in self.tasks:
                run = run_task(task, backend, EvalSettings(sampling), chat=chat)
                summary = summarize(run, 0.95, 1000, self.seed)
                for metric, value in summary["metrics"].items():
                    values[f"eval/{task.name}/{metric}"] = value["mean"]
        finally:
            model.train(was_training)
        return values

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
