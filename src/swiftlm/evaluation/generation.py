"""Per-sample metrics of generation tasks: a prediction against its sample's reference.

Every metric maps (prediction, sample) to a float in [0, 1] for one sample; the summary
averages them and bootstraps the interval. Normalization follows SQuAD's evaluation script
(lowercase, punctuation and English articles removed, whitespace collapsed), the convention
most reported exact-match numbers use, so a score can be compared with published ones.

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

from swiftlm.errors import ConfigError
from swiftlm.eval.extract import last_number_text

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
