"""What an evaluation task is, and the record each of its samples gives.

A task is a kind plus samples. The kind decides how a sample is read and scored, each kind in
its own module (`runner.KINDS` lists them):

- `perplexity`: the model's negative log-likelihood of a text (column `text`);
- `generation`: an answer generated for a conversation, scored against its reference
  (`messages` ending with the reference answer, any chat format training reads, or
  `question`/`answer`, `prompt`/`completion`; optional `answers`, accepted short answers);
- `multiple_choice`: the choice the model finds most likely (`question` + `choices` +
  `answer`, the right choice's index or letter);
- `code`: a HumanEval-format problem (`prompt` + `test` + `entry_point`), the generated
  program run with its tests in a sandbox;
- `judge`: an answer compared by a judge model with a baseline answer (task YAML only).

Every kind returns records of the same shape, written one per line to predictions.jsonl:

    {"task", "id", "prompt", "prediction", "extracted", "reference", "scores": {metric: float},
     ...kind-specific fields (the choices' log-probs, the program's sandbox status...)}

so that `--compare` can pair any two evaluations sample by sample, whatever the kind. Where a
task comes from (a data file, a task YAML, a built-in name) is `task_file.py`.
"""

from dataclasses import dataclass, field
from typing import Any

from swiftlm.evaluation.backends import Backend, Sampling


@dataclass(frozen=True)
class Sample:
    """One evaluation item. `prompt` is a conversation (chat tasks) or raw text."""

    id: str  # where it came from: "file.jsonl:12", or the dataset's own id (HumanEval/3)
    prompt: list[dict] | str
    reference: str | None = None
    answers: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()
    label: int | None = None  # index of the right choice
    extra: dict = field(default_factory=dict)  # kind-specific: a code problem, a baseline


@dataclass(frozen=True)
class Task:
    name: str
    kind: str
    samples: tuple[Sample, ...]
    metrics: tuple[str, ...] = ()
    source: str = ""  # the file or built-in name it was read from
    source_sha256: str = ""  # of the data file, so a manifest pins the exact samples
    extraction: str = "strip"  # the rule applied to an answer before it is scored
    max_new_tokens: int | None = None  # None: --max_new_tokens
    system: str | None = None
    options: dict = field(default_factory=dict)  # kind-specific settings from the YAML

    def limited(self, limit: int | None) -> "Task":
        """The first `limit` samples (in file order): the same ones every time."""
        if limit is None or limit >= len(self.samples):
            return self
        return Task(**{**self.__dict__, "samples": self.samples[:limit]})


@dataclass(frozen=True)
class EvalSettings:
    """How every task of one evaluation runs."""

    sampling: Sampling
    sandbox_timeout: float = 10.0
    sandbox_memory_mb: int = 1024
    judge: Any = None  # an EndpointBackend for judge tasks


def sample_record(
    task: Task, sample: Sample, prediction: str | None, scores: dict, **extra
) -> dict:
    """One sample's line of predictions.jsonl."""
    prompt = sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1]["content"]
    return {
        "task": task.name,
        "id": sample.id,
        "prompt": prompt,
        "prediction": prediction,
        "reference": sample.reference,
        "scores": scores,
        **extra,
    }


def conversation(task: Task, prompt: list[dict]) -> list[dict]:
    """The task's system prompt first, unless the conversation has its own."""
    if task.system and prompt[0]["role"] != "system":
        return [{"role": "system", "content": task.system}, *prompt]
    return prompt


def max_tokens(task: Task, settings: EvalSettings) -> int:
    return task.max_new_tokens or settings.sampling.max_new_tokens


def answer_all(task: Task, backend: Backend, settings: EvalSettings) -> list[str]:
    """Every sample's conversation answered, the task's system prompt first."""
    prompts = [conversation(task, s.prompt) for s in task.samples]
    return backend.generate(prompts, settings.sampling, max_tokens(task, settings))
