"""Generation tasks: an answer generated for each conversation, cut down by the task's
extraction rule and scored against the sample's reference by per-sample metrics.

Rows: a conversation whose last assistant message (if any) is the reference answer, in any chat
format training reads, or `question`/`answer`, `prompt`/`completion`; an optional `answers`
list holds the accepted short answers. Judge tasks read the same rows (and their `baseline`).

Extraction rules (a task YAML's `extraction:`). A published score depends on the extraction as
much as on the model, so the rule is part of the task, is applied the same way to every
backend, is written next to each prediction (`extracted`) and is recorded in the manifest.

- `strip`: the answer without surrounding whitespace (the default);
- `first_line`: its first non-empty line;
- `last_number`: the last number written in it (GSM8K style), or "" when there is none;
- `after:<marker>`: the text after the last `<marker>` (e.g. `after:Answer:`), else all;
- `regex:<pattern>`: the first group of the first match (the whole match if no group), else "".

Metrics (a task YAML's `metrics:`). Every metric maps (prediction, sample) to a float in
[0, 1] for one sample; the summary averages them and bootstraps the interval. Normalization
follows SQuAD's evaluation script (lowercase, punctuation and English articles removed,
whitespace collapsed), the convention most reported exact-match numbers use, so a score can be
compared with published ones.

- `exact_match`: the normalized prediction equals the normalized reference (or one of the
  sample's accepted `answers`).
- `answer_match`: one of the accepted answers (else the reference) occurs in the normalized
  prediction as whole words: a chat model's "The capital of Peru is Lima." matches "Lima".
- `numeric_match`: the last number of the prediction equals the reference's number (GSM8K
  style: the reference's `#### N`, else its last number), within 1e-6 relative.
- `rouge_l`: ROUGE-L F1 (Google's `rouge-score`, no stemming).
- `bleu`, `chrf`: sentence BLEU and chrF from `sacrebleu`, divided by 100.
"""

import math
import re
import string
import unicodedata
from collections.abc import Callable
from functools import cache

from swiftlm.data.formats import RowError, layouts_of, refuse_two_layouts, to_messages
from swiftlm.errors import ConfigError
from swiftlm.evaluation.backends import Backend
from swiftlm.evaluation.tasks import EvalSettings, Sample, Task, answer_all, sample_record

# ---- rows ----------------------------------------------------------------------------------------


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


def read_row(record: dict, placeholders: dict[str, str]) -> dict:
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


# ---- extraction ----------------------------------------------------------------------------------

# A number as written in answers: optional sign, thousands separators, decimals.
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
RULES = ("strip", "first_line", "last_number", "after:<marker>", "regex:<pattern>")


def extractor(rule: str, where: str) -> Callable[[str], str]:
    """The function of an extraction rule; a bad rule is a ConfigError naming `where`."""
    name, _, argument = rule.partition(":")
    if rule == "strip":
        return str.strip
    if rule == "first_line":
        return _first_line
    if rule == "last_number":
        return last_number_text
    if name == "after" and argument:
        return lambda text: text.rsplit(argument, 1)[-1].strip()
    if name == "regex" and argument:
        try:
            pattern = re.compile(argument, re.DOTALL)
        except re.error as exc:
            raise ConfigError(
                f"{where}: extraction {rule!r} is not a valid regex ({exc})"
            ) from None
        return lambda text: _regex(pattern, text)
    raise ConfigError(f"{where}: unknown extraction {rule!r}; use one of {', '.join(RULES)}")


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def last_number_text(text: str) -> str:
    """The last number in `text`, thousands separators dropped; "" when there is none."""
    found = NUMBER.findall(text)
    return found[-1].replace(",", "") if found else ""


def _regex(pattern: re.Pattern, text: str) -> str:
    match = pattern.search(text)
    if match is None:
        return ""
    return (match.group(1) if pattern.groups else match.group(0)).strip()


# ---- metrics -------------------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation) | {"“", "”", "‘", "’", "。", "，", "？", "！"}

EVAL_EXTRA = "pip install 'swiftlm[eval]'"


def normalize_answer(text: str) -> str:
    """SQuAD normalization (after Unicode NFKC): lowercase, no punctuation or articles."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def accepted_answers(sample) -> list[str]:
    """The sample's accepted short answers, else its reference."""
    if sample.answers:
        return list(sample.answers)
    return [sample.reference] if sample.reference is not None else []


def exact_match(prediction: str, sample) -> float:
    wanted = {normalize_answer(a) for a in accepted_answers(sample)}
    return float(normalize_answer(prediction) in wanted)


def answer_match(prediction: str, sample) -> float:
    padded = f" {normalize_answer(prediction)} "
    answers = (normalize_answer(a) for a in accepted_answers(sample))
    return float(any(a and f" {a} " in padded for a in answers))


def last_number(text: str) -> float | None:
    """The last number written in `text` (commas as thousands separators), or None."""
    found = last_number_text(text)
    try:
        return float(found) if found else None
    except ValueError:
        return None


def reference_number(reference: str) -> float | None:
    """GSM8K's `#### 42` when present, else the reference's last number."""
    marker = reference.rsplit("####", 1)
    return last_number(marker[1] if len(marker) == 2 else reference)


def numeric_match(prediction: str, sample) -> float:
    got = last_number(prediction)
    wanted = [reference_number(a) for a in accepted_answers(sample)]
    if got is None:
        return 0.0
    return float(any(w is not None and math.isclose(got, w, rel_tol=1e-6) for w in wanted))


@cache
def _rouge_scorer():
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        raise ConfigError(
            f"the rouge_l metric needs the rouge-score package: {EVAL_EXTRA}"
        ) from None
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(prediction: str, sample) -> float:
    if sample.reference is None:
        return 0.0
    return _rouge_scorer().score(sample.reference, prediction)["rougeL"].fmeasure


def _sacrebleu():
    try:
        import sacrebleu
    except ImportError:
        raise ConfigError(f"the bleu and chrf metrics need sacrebleu: {EVAL_EXTRA}") from None
    return sacrebleu


def bleu(prediction: str, sample) -> float:
    if sample.reference is None:
        return 0.0
    return _sacrebleu().sentence_bleu(prediction, [sample.reference]).score / 100.0


def chrf(prediction: str, sample) -> float:
    if sample.reference is None:
        return 0.0
    return _sacrebleu().sentence_chrf(prediction, [sample.reference]).score / 100.0


GENERATION_METRICS: dict[str, Callable[[str, object], float]] = {
    "exact_match": exact_match,
    "answer_match": answer_match,
    "numeric_match": numeric_match,
    "rouge_l": rouge_l,
    "bleu": bleu,
    "chrf": chrf,
}
# Metrics every generation task reports unless its YAML lists its own.
DEFAULT_GENERATION_METRICS = ("exact_match", "answer_match", "rouge_l", "chrf")


def check_metric_names(names, where: str) -> None:
    unknown = [n for n in names if n not in GENERATION_METRICS]
    if unknown:
        raise ConfigError(
            f"{where}: unknown metric {', '.join(unknown)}; generation tasks support "
            f"{', '.join(GENERATION_METRICS)}"
        )


# ---- running -------------------------------------------------------------------------------------


def run(task: Task, backend: Backend, settings: EvalSettings, chat: bool) -> list[dict]:
    answers = answer_all(task, backend, settings)
    extract = extractor(task.extraction, f"task {task.name}")
    records = []
    for sample, answer in zip(task.samples, answers, strict=True):
        extracted = extract(answer)
        scores = {m: GENERATION_METRICS[m](extracted, sample) for m in task.metrics}
        records.append(sample_record(task, sample, answer, scores, extracted=extracted))
    return records
