"""Evaluation tasks: what a task is, and how one is read from a data file.

A task is a kind plus samples. The kind decides how a sample is scored:

- `perplexity`: the model's negative log-likelihood of a text (column `text`);
- `generation`: an answer generated for a conversation, scored against its reference
  (`messages` ending with the reference answer, any chat format training reads, or
  `question`/`answer`, `prompt`/`completion`; optional `answers`, accepted short answers);
- `multiple_choice`: the choice the model finds most likely (`question` + `choices` +
  `answer`, the right choice's index or letter);
- `code`: a HumanEval-format problem (`prompt` + `test` + `entry_point`), the generated
  program run with its tests in a sandbox;
- `judge`: an answer compared by a judge model with a baseline answer (task YAML only).

A data file says its kind by its columns (`kind_of_row`); a task YAML (`task_file.py`) can
name it and set metrics, extraction and prompts. Every row is validated before the model
loads, with `file:line: reason` for each bad one, like training data.
"""

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from swiftlm.data.formats import RowError, layouts_of, refuse_two_layouts, to_messages
from swiftlm.data.loading import load_samples
from swiftlm.data.sources import BUILTIN_DATASETS, builtin_dataset_path, parse_dataset_spec
from swiftlm.errors import DataError

KINDS = ("perplexity", "generation", "multiple_choice", "code", "judge")
CHOICE_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


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


def kind_of_row(record: dict) -> str:
    """The task kind a row's columns describe."""
    if {"prompt", "test", "entry_point"} <= record.keys():
        return "code"
    if "choices" in record:
        return "multiple_choice"
    if "text" in record and not ({"messages", "query", "prompt"} & record.keys()):
        return "perplexity"
    return "generation"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_file_path(spec: str) -> Path | None:
    """The local file of a dataset spec (built-in or path); None for a hub dataset."""
    path, _ = parse_dataset_spec(spec)
    if path in BUILTIN_DATASETS:
        return builtin_dataset_path(path)
    local = Path(path).expanduser()
    return local if local.exists() else None


def task_name_of(spec: str) -> str:
    path, _ = parse_dataset_spec(spec)
    stem = Path(path).stem if Path(path).suffix else path.rsplit("/", 1)[-1]
    return stem.replace("-", "_")


def read_task_rows(spec: str, kind: str | None, placeholders: dict[str, str]) -> tuple[str, list]:
    """(kind, samples) of a data file, every row validated (DataValidationError lists all)."""
    if kind is None:
        kind = _first_row_kind(spec)
    to_sample = ROW_SCHEMAS[kind]
    rows, _ = load_samples([spec], lambda r: to_sample(r, placeholders))
    return kind, [_with_id(row) for row in rows]


def _first_row_kind(spec: str) -> str:
    from swiftlm.data.sources import read_rows

    path, _ = parse_dataset_spec(spec)
    for row in read_rows(path):
        if row.record is not None:
            return kind_of_row(row.record)
    raise DataError(f"--eval_dataset {spec}: no readable row to tell the task's kind from")


def _with_id(row: dict) -> Sample:
    sample: Sample = row["sample"]
    if sample.id:
        return sample
    return Sample(**{**sample.__dict__, "id": row["source"]})


def _fill(text: str, placeholders: dict[str, str]) -> str:
    for key, value in placeholders.items():
        text = text.replace(key, value)
    return text


def _strings(record: dict, key: str, placeholders: dict[str, str]) -> tuple[str, ...]:
    value = record.get(key)
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RowError("bad field type", f"'{key}' must be a string or a list of strings")
    return tuple(_fill(v, placeholders) for v in value)


# Evaluation sets often come as a question and its answer (GSM8K, TriviaQA) or a prompt and
# its completion: one user turn and the reference.
QA_COLUMNS = (("question", "answer"), ("prompt", "completion"))


def _qa_messages(record: dict) -> list[dict] | None:
    pairs = [f"'{p}' + '{a}'" for p, a in QA_COLUMNS if _texts(record, p, a)]
    refuse_two_layouts(pairs + layouts_of(record))
    for prompt, answer in QA_COLUMNS:
        if isinstance(record.get(prompt), str) and isinstance(record.get(answer), str):
            if not record[prompt].strip():
                raise RowError("empty prompt", f"'{prompt}' is empty")
            user = {"role": "user", "content": record[prompt]}
            return [user, {"role": "assistant", "content": record[answer]}]
    return None


def _texts(record: dict, *keys: str) -> bool:
    return all(isinstance(record.get(key), str) for key in keys)


def generation_row(record: dict, placeholders: dict[str, str]) -> dict:
    """A conversation whose last assistant message (if any) is the reference answer."""
    messages = _qa_messages(record) or to_messages(record, require_answer=False)
    messages = [{**m, "content": _fill(m["content"], placeholders)} for m in messages]
    reference = None
    if messages[-1]["role"] == "assistant":
        reference = messages.pop()["content"]
    answers = _strings(record, "answers", placeholders)
    if reference is None and not answers:
        raise RowError(
            "no reference",
            "no reference answer: end the conversation with the assistant's answer, or give "
            "an 'answers' list",
        )
    if not isinstance(reference, str | None):
        raise RowError("bad field type", "the reference answer must be text")
    sample = Sample("", messages, reference, answers, extra=_baseline(record))
    return {"sample": sample}


def _baseline(record: dict) -> dict:
    baseline = record.get("baseline")
    if baseline is None:
        return {}
    if not isinstance(baseline, str) or not baseline.strip():
        raise RowError("bad field type", "'baseline' (the judge's other answer) must be text")
    return {"baseline": baseline}


def perplexity_row(record: dict, placeholders: dict[str, str]) -> dict:
    text = record.get("text")
    if not isinstance(text, str) or not text.strip():
        raise RowError("empty text", "'text' must be a non-empty string")
    return {"sample": Sample("", text)}


QUESTION_COLUMNS = ("question", "query", "prompt")
ANSWER_COLUMNS = ("answer", "label")


def multiple_choice_row(record: dict, placeholders: dict[str, str]) -> dict:
    # `query` may be the question; a conversation beside the choices is another task's row.
    chats = [name for name in layouts_of(record) if not name.startswith("'query'")]
    refuse_two_layouts(["'choices' (multiple choice)", *chats])
    question = _one_of(record, QUESTION_COLUMNS, "question")
    if not isinstance(question, str) or not question.strip():
        raise RowError("no question", "a multiple-choice row needs a 'question' string")
    choices = record.get("choices")
    if not isinstance(choices, list) or len(choices) < 2:
        raise RowError("bad choices", "'choices' must be a list of at least 2 strings")
    if not all(isinstance(c, str) and c.strip() for c in choices):
        raise RowError("bad choices", "every choice must be a non-empty string")
    _refuse_repeated_choices(choices)
    labels = {
        key: _choice_label(record[key], choices, key) for key in ANSWER_COLUMNS if key in record
    }
    if not labels:
        raise RowError("no answer", "'answer' must be the right choice's index or letter")
    if len(set(labels.values())) > 1:
        raise RowError(
            "bad answer",
            f"'answer' {record['answer']!r} and 'label' {record['label']!r} name different "
            "choices; keep the one that is right",
        )
    label = next(iter(labels.values()))
    return {"sample": Sample("", question, choices=tuple(choices), label=label)}


def _one_of(record: dict, keys: tuple[str, ...], what: str):
    """The value of the one column of `keys` the row has: two could each be the question."""
    present = [key for key in keys if key in record]
    if len(present) > 1:
        raise RowError(
            "two layouts",
            f"the row has {' and '.join(repr(k) for k in present)}, each of which could be the "
            f"{what}: keep one",
        )
    return record[present[0]] if present else None


def _refuse_repeated_choices(choices: list[str]) -> None:
    """Two equal choices: the right one's likelihood is also a wrong one's, and an answer
    given as text names two indexes, so the row's score is undefined."""
    seen: dict[str, int] = {}
    for number, choice in enumerate(choices, start=1):
        key = choice.strip()
        if key in seen:
            raise RowError(
                "bad choices",
                f"choices {seen[key]} and {number} are both {choice!r}: with a repeated "
                "choice the row's score is undefined; make every choice different",
            )
        seen[key] = number


def _choice_label(answer, choices: list[str], key: str = "answer") -> int:
    if isinstance(answer, bool) or answer is None:
        raise RowError("no answer", f"{key!r} must be the right choice's index or letter")
    if isinstance(answer, int):
        index = answer
    elif isinstance(answer, str) and len(answer.strip()) == 1 and answer.strip().isalpha():
        index = CHOICE_LETTERS.index(answer.strip().upper())
        if answer in choices and choices.index(answer) != index:
            raise RowError(
                "bad answer",
                f"{key!r} {answer!r} is both the letter of choice {index + 1} and the text of "
                f"choice {choices.index(answer) + 1}; give the index instead",
            )
    elif isinstance(answer, str) and answer in choices:
        index = choices.index(answer)
    else:
        raise RowError("bad answer", f"{key!r} {answer!r} is not an index, letter or choice")
    if not 0 <= index < len(choices):
        raise RowError("bad answer", f"{key!r} {answer!r} is outside the {len(choices)} choices")
    return index


def code_row(record: dict, placeholders: dict[str, str]) -> dict:
    for key in ("prompt", "test", "entry_point"):
        if not isinstance(record.get(key), str) or not record[key].strip():
            raise RowError("bad code problem", f"'{key}' must be a non-empty string")
    problem = {k: record[k] for k in ("prompt", "test", "entry_point")}
    task_id = record.get("task_id")
    sample = Sample(task_id if isinstance(task_id, str) else "", record["prompt"], extra=problem)
    return {"sample": sample}


ROW_SCHEMAS = {
    "generation": generation_row,
    "judge": generation_row,
    "perplexity": perplexity_row,
    "multiple_choice": multiple_choice_row,
    "code": code_row,
}
