"""Multiple-choice tasks: the choice the model finds most likely.

Rows: `question` (or `query`, `prompt`) + `choices` (at least 2, all different) + `answer` (or
`label`): the right choice's index, letter or text. Each choice is scored as the continuation
of the task's template (its YAML's `template:`, default `MC_TEMPLATE`), so it needs the
model's log-likelihoods (`loglik.continuation_logprobs`), which only the local backend has.
`acc` takes the most likely choice, `acc_norm` the most likely per byte (as lm-eval), so that
long choices are fair.
"""

from swiftlm.data.formats import RowError, layouts_of, refuse_two_layouts
from swiftlm.evaluation.backends import Backend
from swiftlm.evaluation.tasks import EvalSettings, Sample, Task, sample_record

CHOICE_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
MC_TEMPLATE = "Question: {question}\nAnswer:"
QUESTION_COLUMNS = ("question", "query", "prompt")
ANSWER_COLUMNS = ("answer", "label")


def read_row(record: dict, placeholders: dict[str, str]) -> dict:
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


def run(task: Task, backend: Backend, settings: EvalSettings, chat: bool) -> list[dict]:
    template = task.options.get("template", MC_TEMPLATE)
    pairs = []
    for sample in task.samples:
        context = template.format(question=sample.prompt)
        pairs += [(context, " " + choice) for choice in sample.choices]
    scores = iter(backend.continuation_logprobs(pairs))  # in the order of `pairs`
    records = []
    for sample in task.samples:
        logprobs = [next(scores).logprob for _ in sample.choices]
        # acc_norm as lm-eval: the log-prob per byte of the choice, so long choices are fair
        normed = [
            lp / len((" " + c).encode()) for lp, c in zip(logprobs, sample.choices, strict=True)
        ]
        picked = max(range(len(logprobs)), key=logprobs.__getitem__)
        picked_norm = max(range(len(normed)), key=normed.__getitem__)
        scores_of = {
            "acc": float(picked == sample.label),
            "acc_norm": float(picked_norm == sample.label),
        }
        records.append(
            sample_record(
                task,
                sample,
                sample.choices[picked],
                scores_of,
                reference=sample.choices[sample.label],
                choice_logprobs=logprobs,
            )
        )
    return records
