"""Data health before step 1: what the tokenized data looks like and how well the chosen batch
layout uses it.

`summarize_data` turns plain facts (sample lengths, label-token counts, the encoder's
truncation counts, the token length of each row of each micro-batch) into a JSON-able dict;
`format_data_health` prints it in a few lines and `write_data_health` keeps it as
<run>/data_health.json. Nothing here imports the training code: the caller (train/prepare.py)
hands in what it knows, so the functions stay pure and testable on hand-made numbers.

The JSON is rendered generically by the report: a dict of {"edges", "counts"} is a bar
histogram, a scalar a table row, a nested dict a section.

Cost: one sort of the lengths and, for label columns, one count per sample (`list.count` in
C, or an Arrow kernel over a cached file), so a few hundred milliseconds per 100k samples at
worst; above LABEL_SAMPLE_LIMIT in-memory samples the label share is estimated from an evenly
spaced subset (and says so).
"""

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from swiftlm.data.encode import IGNORE_INDEX

FILE_NAME = "data_health.json"
HISTOGRAM_BINS = 20
# In-memory samples counted for the label share; beyond this an even subset is counted (a
# cached Arrow file is always counted whole: the kernel is fast).
LABEL_SAMPLE_LIMIT = 200_000


@dataclass(frozen=True)
class SplitFacts:
    """What the caller knows about one split."""

    lengths: Sequence[int]  # tokens of every sample (the method's `length`)
    # (label tokens, tokens they are counted over, samples counted), or why there is no share
    labels: tuple[int, int, int] | str
    truncation: dict = field(default_factory=dict)  # TruncationReport.as_dict()


@dataclass(frozen=True)
class LayoutFacts:
    """The batch plan of one epoch, as plain numbers."""

    kind: str  # "fixed size", "packed", "padding-free", "token budget" (or a combination)
    micro_batches: int  # non-empty rank micro-batches of the epoch
    rows: int
    real_tokens: int  # tokens of the samples
    held_tokens: int  # tokens the micro-batches hold: padded to their longest row (or real)
    row_capacity: int = 0  # --packing: the tokens a packed row may hold (--max_length)

    @classmethod
    def of(cls, kind: str, micro_batches: list[list[int]], padding_free=False, row_capacity=0):
        """From the token length of each row of each rank micro-batch."""
        batches = [b for b in micro_batches if b]
        real = sum(sum(b) for b in batches)
        held = real if padding_free else sum(len(b) * max(b) for b in batches)
        rows = sum(len(b) for b in batches)
        return cls(kind, len(batches), rows, real, held, row_capacity)


def label_columns(columns: Sequence[str]) -> tuple[list[str], list[str]]:
    """(label columns, token-id columns) of a method: `labels`/`*_labels`, `input_ids`/`*_ids`."""
    labels = [c for c in columns if c == "labels" or c.endswith("_labels")]
    ids = [c for c in columns if c.endswith("_ids")]
    return labels, ids


def count_labels(samples: Sequence[dict], columns: Sequence[str]) -> tuple[int, int, int] | str:
    """(label positions != IGNORE_INDEX, tokens of the token-id columns, samples counted), or
    the reason there is no label share (a method without label columns, e.g. GRPO prompts)."""
    labels, ids = label_columns(columns)
    if not labels or not ids:
        return "the method's samples have no label column (its loss is not on given tokens)"
    if len(samples) == 0:
        return "no samples"
    table = getattr(samples, "table", None)  # data.cache.ArrowSamples: count in Arrow
    if table is not None:
        return _arrow_counts(table, labels, ids) + (len(samples),)
    step = max(1, math.ceil(len(samples) / LABEL_SAMPLE_LIMIT))
    picked = [samples[i] for i in range(0, len(samples), step)]
    return _list_counts(picked, labels, ids) + (len(picked),)


def _arrow_counts(table, labels: list[str], ids: list[str]) -> tuple[int, int]:
    import pyarrow.compute as pc

    def flat(name: str):
        return pc.list_flatten(table.column(name))

    marked = sum(int(pc.sum(pc.not_equal(flat(n), IGNORE_INDEX)).as_py() or 0) for n in labels)
    tokens = sum(len(flat(n)) for n in ids)
    return marked, tokens


def _count_marked(values) -> int:
    if isinstance(values, list):  # list.count runs in C: ~10x a Python loop
        return len(values) - values.count(IGNORE_INDEX)
    return int(np.count_nonzero(np.asarray(values) != IGNORE_INDEX))


def _list_counts(samples: Sequence[dict], labels: list[str], ids: list[str]) -> tuple[int, int]:
    marked = sum(_count_marked(s[name]) for s in samples for name in labels)
    tokens = sum(len(s[name]) for s in samples for name in ids)
    return marked, tokens


def length_stats(lengths: Sequence[int]) -> dict:
    """min, mean, nearest-rank p50 and p95, max."""
    ordered = np.sort(np.asarray(lengths, dtype=np.int64))

    def rank(p: float) -> int:
        return int(ordered[max(0, math.ceil(p * len(ordered)) - 1)])

    return {
        "min": int(ordered[0]),
        "mean": round(float(ordered.mean()), 1),
        "p50": rank(0.5),
        "p95": rank(0.95),
        "max": int(ordered[-1]),
    }


def length_histogram(lengths: Sequence[int], bins: int = HISTOGRAM_BINS) -> dict:
    """Integer-edged bins [edges[k], edges[k+1]) of equal width from the shortest sample, at
    most `bins` of them: exact counts, readable edges."""
    values = np.asarray(lengths, dtype=np.int64)
    low, high = int(values.min()), int(values.max())
    width = max(1, math.ceil((high - low + 1) / bins))
    count = math.ceil((high - low + 1) / width)
    counts = np.bincount((values - low) // width, minlength=count)
    return {"edges": [low + k * width for k in range(count + 1)], "counts": counts.tolist()}


def split_summary(facts: SplitFacts) -> dict:
    lengths = facts.lengths
    summary: dict = {"samples": len(lengths), "tokens": int(sum(lengths))}
    if not lengths:
        return summary
    summary["length"] = length_stats(lengths)
    summary["length_histogram"] = length_histogram(lengths)
    if isinstance(facts.labels, str):
        summary["label_token_share"] = None
        summary["label_token_share_note"] = facts.labels
    else:
        marked, tokens, counted = facts.labels
        summary["label_token_share"] = round(marked / tokens, 4) if tokens else 0.0
        if counted < len(lengths):
            summary["label_token_share_note"] = f"estimated on {counted} of {len(lengths)}"
    if facts.truncation:
        summary["truncation"] = dict(facts.truncation)
    return summary


def layout_summary(facts: LayoutFacts) -> dict:
    """Real tokens over the tokens the micro-batches hold: right-padded rows (one sample each,
    or packed) take the longest row of their micro-batch; padding-free holds no padding."""
    real, held = facts.real_tokens, facts.held_tokens
    efficiency = real / held if held else 1.0
    summary = {
        "kind": facts.kind,
        "micro_batches_per_epoch": facts.micro_batches,
        "rows_per_epoch": facts.rows,
        "real_tokens": real,
        "held_tokens": held,
        "efficiency": round(efficiency, 4),
        "padding_share": round(1 - efficiency, 4),
    }
    if facts.row_capacity:
        rows = summary["rows_per_epoch"]
        summary["packed_row_fill"] = round(real / (rows * facts.row_capacity), 4) if rows else 0.0
    return summary


def summarize_data(train: SplitFacts, validation: SplitFacts | None, layout: LayoutFacts) -> dict:
    """The data-health summary (see the module docstring for the schema)."""
    summary = {"train": split_summary(train)}
    if validation is not None and len(validation.lengths):
        summary["validation"] = split_summary(validation)
    summary["layout"] = layout_summary(layout)
    return summary


def _truncation_phrase(truncation: dict) -> str:
    """ "; 3 truncated, 1 deleted at 2048 tokens": the limit is the one the method applied
    (--max_length, or for prompt methods --max_length minus --max_completion_length)."""
    if not truncation:
        return ""
    keys = ("truncated", "deleted", "dropped")
    parts = ", ".join(f"{truncation[k]} {k}" for k in keys if truncation.get(k))
    return f"; {parts or 'none truncated'} at {truncation.get('max_length')} tokens"


def format_data_health(summary: dict) -> str:
    """1-2 lines: sizes and lengths, labels and truncation. The batch layout's fill is in
    data_health.json; the log's `batches:` line (train.batching.describe_plan) prints it."""
    lines = []
    for name, label in (("train", "data"), ("validation", "validation data")):
        split = summary.get(name)
        if not split or not split.get("samples"):
            continue
        n = split["samples"]
        line = f"{label}: {n:,} sample{'s' * (n != 1)}, {split['tokens']:,} tokens"
        if name == "train":
            k = split["length"]
            line += f"; length min/p50/p95/max {k['min']}/{k['p50']}/{k['p95']}/{k['max']}"
            line += _truncation_phrase(split.get("truncation", {}))
            share = split.get("label_token_share")
            if share is not None:
                line += f"; labels {100 * share:.0f}% of tokens"
        lines.append(line)
    return "\n".join(lines)


def write_data_health(summary: dict, run_dir: Path) -> Path:
    path = Path(run_dir) / FILE_NAME
    path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return path
