"""Training/evaluation overlap: which evaluation items appear (near-)verbatim in training data.

A model that trained on a test item scores well on it by memory, not by skill. Following
GPT-3 and lm-eval-harness's decontamination, an item counts as contaminated when its word
n-grams (n = 13 by default) also occur in a training text.

Rules, each chosen so the check is predictable:

- Normalization (both sides alike): Unicode NFKC, lowercase, every character that is neither
  a letter, a digit nor whitespace becomes a space (so "Paris," and "paris" match and
  "a/b" is two words), then split on whitespace. NFKC folds full-width letters and ligatures
  into their plain forms.
- Short items: an item with fewer than n words has no n-gram. If it has at least `min_n`
  words (8 by default, or n when n < 8) it is checked with n = its length, i.e. "does the
  whole item occur in a training text?"; below `min_n` words a match is too likely to be a
  common phrase, so the item is counted as too short to check rather than reported clean.
- An item's overlap ratio is the share of its n-grams found in training; it is flagged when
  the ratio is above `threshold` (0 by default: any shared n-gram flags it).

N-grams are stored as 64-bit hashes, not strings: each word gets a stable 8-byte blake2b
hash, and an n-gram's hash is a polynomial of its words' hashes modulo 2**64, computed for
all positions at once with numpy. For a training set with N distinct n-grams, a false match
has probability about N / 2**64 per evaluation n-gram (negligible), and the index costs
8 bytes per distinct n-gram per length it stores. `build_index` stores lengths min_n..n
(6 lengths by default) so that short items can be looked up; for a corpus too large for
that, `scan` indexes the (small) evaluation side instead and streams the training texts once.

`contamination_section` is the check `swiftlm eval` runs before the model loads (written to
contamination.json): the training data is `--dataset` when given, else the datasets of the
run being evaluated (its config.yaml), with placeholders ({{NAME}}, {{AUTHOR}}) filled as the
run filled them, so the check sees the text the model was trained on.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from swiftlm.config.parse import load_run_config
from swiftlm.data.sources import parse_dataset_spec, read_rows
from swiftlm.errors import ConfigError, DataError

if TYPE_CHECKING:
    from swiftlm.evaluation.tasks import Task

DEFAULT_N = 13
DEFAULT_MIN_N = 8

# Odd, so multiplying by it is a bijection modulo 2**64 (no hash bits are lost).
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
_NOT_WORD = re.compile(r"[^\w\s]|_")
# Compact the buffered hashes into the sorted index once this many are pending (32 MiB).
_COMPACT_EVERY = 1 << 22
# Word hashes are cached per call; past this many distinct words the cache starts over, so a
# huge vocabulary cannot grow it without bound (about 100 bytes an entry).
_MAX_CACHED_WORDS = 1 << 20

# Row fields that hold text, in the order they are joined (see texts_of_row).
_TEXT_FIELDS = (
    "query",
    "instruction",
    "input",
    "prompt",
    "question",
    "text",
    "response",
    "output",
    "completion",
    "answer",
)
_EMPTY = np.empty(0, dtype=np.uint64)


@dataclass(frozen=True)
class NgramIndex:
    """Sorted unique 64-bit hashes of the training n-grams, one array per n-gram length."""

    n: int
    min_n: int
    hashes: dict[int, np.ndarray]

    def contains(self, length: int, queries: np.ndarray) -> np.ndarray:
        """Which of `queries` (hashes of `length`-grams) occur in the training texts."""
        return _member(self.hashes.get(length, np.empty(0, np.uint64)), queries)


@dataclass(frozen=True)
class ItemOverlap:
    """One evaluation item: how many of its n-grams (of length `n_used`) are in training."""

    id: str
    words: int
    n_used: int
    ngrams: int
    matched: int
    ratio: float
    contaminated: bool
    too_short: bool


@dataclass
class ContaminationReport:
    """Per-item overlaps and the totals a user reads first."""

    n: int
    min_n: int
    threshold: float
    items: list[ItemOverlap] = field(default_factory=list)

    @property
    def checked(self) -> int:
        return sum(not item.too_short for item in self.items)

    @property
    def contaminated(self) -> int:
        return sum(item.contaminated for item in self.items)

    @property
    def too_short(self) -> int:
        return sum(item.too_short for item in self.items)

    @property
    def share(self) -> float:
        """Contaminated share of the checked items (0 when none could be checked)."""
        return self.contaminated / self.checked if self.checked else 0.0

    def summary(self) -> dict:
        return {
            "n": self.n,
            "min_n": self.min_n,
            "threshold": self.threshold,
            "items": len(self.items),
            "checked": self.checked,
            "contaminated": self.contaminated,
            "contaminated_share": self.share,
            "too_short": self.too_short,
        }


def normalize(text: str) -> list[str]:
    """The words of `text` after NFKC, lowercasing and turning punctuation into spaces."""
    folded = unicodedata.normalize("NFKC", text).lower()
    return _NOT_WORD.sub(" ", folded).split()


def ngram_hashes(words: list[str], length: int, cache: dict[str, int] | None = None) -> np.ndarray:
    """The 64-bit hashes of every `length`-gram of `words` (empty if too few words).

    `cache` maps words to their hashes across calls (a word is hashed once per dict).
    """
    words_hashed = _word_hashes(words, {} if cache is None else cache)
    return _hashes_by_length(words_hashed, [length]).get(length, _EMPTY)


def build_index(
    train_texts: Iterable[str], n: int = DEFAULT_N, *, min_n: int | None = None
) -> NgramIndex:
    """Hash the training texts' n-grams of every length min_n..n (n-grams never span texts).

    `min_n` (default min(8, n)) is the shortest item length still checked, as its whole.
    """
    n, min_n = _lengths(n, min_n)
    lengths = list(range(min_n, n + 1))
    store = {length: _SortedSet() for length in lengths}
    cache: dict[str, int] = {}
    for text in train_texts:
        by_length = _hashes_by_length(_word_hashes(normalize(text), cache), lengths)
        for length, hashes in by_length.items():
            store[length].add(hashes)
    return NgramIndex(n, min_n, {length: s.finish() for length, s in store.items()})


def check(
    index: NgramIndex, eval_items: list[tuple[str, str]], *, threshold: float = 0.0
) -> ContaminationReport:
    """Look every (id, text) evaluation item up in a training index."""
    _check_threshold(threshold)
    report = ContaminationReport(index.n, index.min_n, threshold)
    cache: dict[str, int] = {}
    for item_id, text in eval_items:
        words = normalize(text)
        length = _length_for(len(words), index.n, index.min_n)
        if length is None:
            report.items.append(_too_short(item_id, len(words)))
            continue
        hashes = ngram_hashes(words, length, cache)
        matched = int(index.contains(length, hashes).sum())
        report.items.append(_overlap(item_id, len(words), length, hashes.size, matched, threshold))
    return report


def scan(
    train_texts: Iterable[str],
    eval_items: list[tuple[str, str]],
    n: int = DEFAULT_N,
    *,
    min_n: int | None = None,
    threshold: float = 0.0,
) -> ContaminationReport:
    """The same report as `check(build_index(...))`, in memory bounded by the evaluation set.

    Hashes the evaluation items' n-grams first, then streams the training texts once and
    keeps only the hashes the items need: use it for a training corpus whose index would not
    fit in memory.
    """
    n, min_n = _lengths(n, min_n)
    _check_threshold(threshold)
    cache: dict[str, int] = {}
    items = [_prepare(item_id, text, n, min_n, cache) for item_id, text in eval_items]
    needed = _needed_hashes((item[2], item[3]) for item in items if item[2] is not None)
    found = {length: _SortedSet() for length in needed}
    for text in train_texts if needed else ():
        by_length = _hashes_by_length(_word_hashes(normalize(text), cache), list(needed))
        for length, hashes in by_length.items():
            found[length].add(hashes[_member(needed[length], hashes)])
    seen = {length: s.finish() for length, s in found.items()}
    report = ContaminationReport(n, min_n, threshold)
    for item_id, words, length, hashes in items:
        if length is None:
            report.items.append(_too_short(item_id, words))
            continue
        matched = int(_member(seen[length], hashes).sum())
        report.items.append(_overlap(item_id, words, length, hashes.size, matched, threshold))
    return report


def texts_of_row(row: dict) -> str:
    """The text of a dataset row to check for overlap, its fields joined by newlines.

    Takes the user and assistant contents of a `messages` list (system prompts are left out:
    a shared boilerplate system prompt would match every row), a `history` of [query,
    response] pairs, and whichever of query/instruction/input/prompt/question/text/response/
    output/completion/answer are strings (or, for prompt/completion, message lists).
    """
    parts = _message_texts(row.get("messages"))
    for pair in row.get("history") or []:
        if isinstance(pair, (list, tuple)):
            parts += [p for p in pair if isinstance(p, str)]
    for name in _TEXT_FIELDS:
        value = row.get(name)
        parts += [value] if isinstance(value, str) else _message_texts(value)
    return "\n".join(part for part in parts if part)


# ---- the check of `swiftlm eval` -----------------------------------------------------------------


def training_specs(cfg, spec) -> tuple[list[str], str]:
    """(dataset specs, where they came from)."""
    if cfg.data.dataset:
        return list(cfg.data.dataset), "--dataset"
    if spec is not None and spec.ckpt_dir:
        saved = Path(spec.ckpt_dir) / "config.yaml"
        if saved.is_file():
            run = load_run_config(saved)
            return list(run.data.dataset), str(saved)
    return [], ""


def training_texts(specs: list[str], placeholders: dict[str, str]):
    for spec in specs:
        path, _ = parse_dataset_spec(spec)
        for row in read_rows(path):
            if row.record is None:
                continue
            text = texts_of_row(row.record)
            for key, value in placeholders.items():
                text = text.replace(key, value)
            yield text


def sample_text(sample) -> str:
    prompt = (
        sample.prompt
        if isinstance(sample.prompt, str)
        else texts_of_row({"messages": sample.prompt})
    )
    parts = [prompt, sample.reference or "", *sample.choices]
    return "\n".join(p for p in parts if p)


def contamination_section(cfg, spec, tasks: list[Task], n: int) -> dict | None:
    """contamination.json's content, or None when no training data is known.

    Training data named by --dataset must be readable (an error otherwise); a run's own data
    that has moved since it trained only skips the check, with a line saying why, since the
    evaluation itself does not need it."""
    specs, origin = training_specs(cfg, spec)
    if not specs or n == 0:
        return None
    placeholders = {"{{NAME}}": cfg.model.model_name, "{{AUTHOR}}": cfg.model.model_author}
    try:
        index = build_index(training_texts(specs, placeholders), n, min_n=min(n, 8))
    except DataError as exc:
        if origin == "--dataset":
            raise
        print(f"contamination check skipped: the run's training data ({origin}) {exc}", flush=True)
        return None
    per_task, items = {}, {}
    for task in tasks:
        report = check(index, [(s.id, sample_text(s)) for s in task.samples])
        per_task[task.name] = report.summary()
        items[task.name] = [
            {"id": i.id, "ratio": i.ratio, "contaminated": i.contaminated, "too_short": i.too_short}
            for i in report.items
        ]
    summary = {"training_data": specs, "from": origin, "n": n, "tasks": per_task}
    return {"summary": summary, "items": items}


# ---- internals -----------------------------------------------------------------------------------


class _SortedSet:
    """A growing set of uint64 hashes kept as one sorted unique array (8 bytes a hash)."""

    def __init__(self) -> None:
        self._sorted = _EMPTY
        self._pending: list[np.ndarray] = []
        self._pending_size = 0

    def add(self, hashes: np.ndarray) -> None:
        self._pending.append(hashes)
        self._pending_size += hashes.size
        if self._pending_size >= _COMPACT_EVERY:
            self._compact()

    def finish(self) -> np.ndarray:
        self._compact()
        return self._sorted

    def _compact(self) -> None:
        if self._pending:
            self._sorted = _sorted_unique(np.concatenate([self._sorted, *self._pending]))
            self._pending, self._pending_size = [], 0


def _sorted_unique(hashes: np.ndarray) -> np.ndarray:
    """np.unique by sorting: for uint64 it is several times faster than numpy 2's hash path."""
    hashes.sort()
    keep = np.empty(hashes.size, dtype=bool)
    keep[:1] = True
    np.not_equal(hashes[1:], hashes[:-1], out=keep[1:])
    return hashes[keep]


def _word_hashes(words: list[str], cache: dict[str, int]) -> np.ndarray:
    """Stable 64-bit hashes of words (blake2b, not hash(): that changes with every process)."""
    if len(cache) > _MAX_CACHED_WORDS:  # hashes are stable: clearing only costs recomputing
        cache.clear()
    out = np.empty(len(words), dtype=np.uint64)
    for i, word in enumerate(words):
        value = cache.get(word)
        if value is None:
            digest = hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest()
            value = cache[word] = int.from_bytes(digest, "little")
        out[i] = value
    return out


def _hashes_by_length(words: np.ndarray, lengths: list[int]) -> dict[int, np.ndarray]:
    """For each requested length, the polynomial hash of every n-gram of that length.

    Extends all n-grams by one word per step: after step k, h[i] hashes words[i : i + k + 1].
    uint64 arithmetic wraps modulo 2**64, which is the intended hash.
    """
    wanted = set(lengths)
    result: dict[int, np.ndarray] = {}
    if not wanted or words.size < min(wanted):
        return result
    hashes = words.copy()
    with np.errstate(over="ignore"):
        for length in range(1, min(max(wanted), words.size) + 1):
            if length > 1:
                hashes = hashes[:-1] * _MULTIPLIER + words[length - 1 :]
            if length in wanted:
                result[length] = hashes
    return result


def _member(sorted_hashes: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Which `queries` occur in the sorted array (binary search, no Python set)."""
    if sorted_hashes.size == 0 or queries.size == 0:
        return np.zeros(queries.size, dtype=bool)
    at = np.searchsorted(sorted_hashes, queries)
    return sorted_hashes[np.minimum(at, sorted_hashes.size - 1)] == queries


def _prepare(item_id, text: str, n: int, min_n: int, cache: dict[str, int]):
    """(id, word count, n-gram length or None when too short, the item's n-gram hashes)."""
    words = normalize(text)
    length = _length_for(len(words), n, min_n)
    hashes = _EMPTY if length is None else ngram_hashes(words, length, cache)
    return item_id, len(words), length, hashes


def _needed_hashes(pairs: Iterable[tuple[int, np.ndarray]]) -> dict[int, np.ndarray]:
    """The distinct hashes the evaluation items need, by n-gram length."""
    by_length: dict[int, list[np.ndarray]] = {}
    for length, hashes in pairs:
        by_length.setdefault(length, []).append(hashes)
    return {length: _sorted_unique(np.concatenate(parts)) for length, parts in by_length.items()}


def _length_for(words: int, n: int, min_n: int) -> int | None:
    """The n-gram length an item of `words` words is checked with; None: too short."""
    if words >= n:
        return n
    return words if words >= min_n else None


def _overlap(item_id, words: int, length: int, ngrams: int, matched: int, threshold: float):
    ratio = matched / ngrams if ngrams else 0.0
    return ItemOverlap(
        str(item_id), words, length, ngrams, matched, ratio, ratio > threshold, False
    )


def _too_short(item_id, words: int) -> ItemOverlap:
    return ItemOverlap(str(item_id), words, 0, 0, 0, 0.0, False, True)


def _message_texts(messages) -> list[str]:
    if not isinstance(messages, list):
        return []
    texts = []
    for message in messages:
        if isinstance(message, dict) and message.get("role") in ("user", "assistant"):
            texts += _content_texts(message.get("content"))
    return texts


def _content_texts(content) -> list[str]:
    """A message's text: a string, or the text parts of an OpenAI-style list of parts."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
    return []


def _lengths(n: int, min_n: int | None) -> tuple[int, int]:
    """(n, min_n), min_n defaulting to min(DEFAULT_MIN_N, n) so any n >= 1 works alone."""
    min_n = min(DEFAULT_MIN_N, n) if min_n is None else min_n
    if n < 1 or not 1 <= min_n <= n:
        raise ConfigError(
            f"contamination n-gram lengths n={n} (--contamination_ngram), min_n={min_n} are "
            f"invalid: need 1 <= min_n <= n (defaults: n={DEFAULT_N}, min_n={DEFAULT_MIN_N})"
        )
    return n, min_n


def _check_threshold(threshold: float) -> None:
    if not 0.0 <= threshold < 1.0:
        raise ConfigError(
            f"contamination threshold {threshold} is invalid: it is the overlap ratio above "
            "which an item is flagged, in [0, 1); 0 flags any shared n-gram"
        )
