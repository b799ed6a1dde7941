"""Compare two evaluation results folders sample by sample (`swiftlm eval --compare A B`).

Each folder holds the `predictions.jsonl` a `swiftlm eval` run writes: one line per (task,
sample) with per-sample `scores`. Samples are matched by (task, id) and, per task and metric,
B is tested against A with `stats.paired_difference`: pairing is what lets a small but
consistent improvement show up as significant. Nothing is dropped silently: samples found in
only one folder are counted per task, and metrics found on only one side are listed as
skipped with the reason.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from swiftlm.errors import ConfigError, DataError
from swiftlm.evaluation.stats import PairedDifference, paired_difference

PREDICTIONS = "predictions.jsonl"
SUMMARY = "summary.json"
MANIFEST = "manifest.json"

# Metrics where a lower value is better; "B better" must follow the metric's direction.
_LOWER_IS_BETTER = ("nll", "perplexity", "ppl", "loss", "error", "wer", "cer", "latency")


@dataclass
class Results:
    """One evaluation: per-sample scores keyed by (task, id), plus its summary and manifest."""

    folder: Path
    scores: dict[tuple[str, str], dict[str, float]]
    summary: dict | None = None
    manifest: dict | None = None

    @property
    def model_description(self) -> str | None:
        model = (self.manifest or {}).get("model")
        return model.get("description") if isinstance(model, dict) else None


@dataclass(frozen=True)
class MetricComparison:
    """B against A on one task's metric, over the samples scored on both sides."""

    task: str
    metric: str
    result: PairedDifference
    lower_is_better: bool
    verdict: str


@dataclass(frozen=True)
class Skipped:
    """A (task, metric) that could not be compared, and why."""

    task: str
    metric: str
    reason: str


@dataclass(frozen=True)
class TaskMatch:
    """How many of a task's samples are in both folders, and in only one."""

    task: str
    matched: int
    only_a: int
    only_b: int


@dataclass
class Comparison:
    """Everything `format_comparison` prints and `comparison_to_json` writes."""

    folder_a: str
    folder_b: str
    model_a: str | None
    model_b: str | None
    confidence: float
    resamples: int
    seed: int
    tasks: list[TaskMatch] = field(default_factory=list)
    rows: list[MetricComparison] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def load_results(folder) -> Results:
    """Read an evaluation results folder.

    `folder` may also be its predictions.jsonl, or a training run directory: then the newest
    evaluation under its eval/ folder (where `swiftlm eval --ckpt_dir` writes) is read, and
    `Results.folder` says which one.
    """
    path = _results_folder(folder)
    return Results(
        folder=path,
        scores=_read_predictions(path / PREDICTIONS),
        summary=_read_json(path / SUMMARY),
        manifest=_read_json(path / MANIFEST),
    )


def compare_results(
    a: Results, b: Results, *, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> Comparison:
    """Test B against A per (task, metric) on the samples both evaluated."""
    comparison = Comparison(
        folder_a=str(a.folder),
        folder_b=str(b.folder),
        model_a=a.model_description,
        model_b=b.model_description,
        confidence=confidence,
        resamples=resamples,
        seed=seed,
    )
    shared = [key for key in a.scores if key in b.scores]
    if not shared:
        raise ConfigError(
            f"{a.folder} and {b.folder} share no samples (matched by task and id): they "
            f"evaluated different tasks ({_task_list(a)} vs {_task_list(b)}) or different "
            "samples (another --eval_limit or dataset version?); rerun one to match the other"
        )
    comparison.tasks = _task_matches(a, b)
    by_task: dict[str, list[tuple[str, str]]] = {}
    for key in shared:
        by_task.setdefault(key[0], []).append(key)
    for task in sorted(by_task):
        _compare_task(comparison, task, by_task[task], a, b)
    return comparison


def format_comparison(c: Comparison) -> str:
    """A readable report: who A and B are, one table row per (task, metric), then caveats."""
    lines = [f"A: {c.folder_a}" + _model(c.model_a), f"B: {c.folder_b}" + _model(c.model_b), ""]
    header = ("task", "metric", "A", "B", "B-A", f"{c.confidence:.0%} interval", "p", "test")
    table = [header + ("n", "verdict")]
    for row in c.rows:
        r = row.result
        table.append(
            (row.task, row.metric, _num(r.mean_a), _num(r.mean_b), _signed(r.diff))
            + (f"[{_signed(r.low)}, {_signed(r.high)}]", _p(r.p_value), r.test, str(r.n))
            + (row.verdict,)
        )
    lines += _aligned(table)
    lines += _unmatched_lines(c.tasks)
    if c.skipped:
        lines += ["", "Not compared:"]
        lines += [f"  {s.task} / {s.metric}: {s.reason}" for s in c.skipped]
    lines += [
        "",
        f"Differences are B - A on the samples both scored; intervals are paired bootstrap "
        f"({c.resamples} resamples, seed {c.seed}).",
        "p-values are per row, not corrected for comparing many metrics at once.",
    ]
    return "\n".join(lines)


def comparison_to_json(c: Comparison) -> dict:
    """The comparison as plain JSON types, for compare.json."""
    return {
        "a": {"folder": c.folder_a, "model": c.model_a},
        "b": {"folder": c.folder_b, "model": c.model_b},
        "confidence": c.confidence,
        "resamples": c.resamples,
        "seed": c.seed,
        "tasks": [asdict(t) for t in c.tasks],
        "comparisons": [
            {"task": r.task, "metric": r.metric, **asdict(r.result)}
            | {"lower_is_better": r.lower_is_better, "verdict": r.verdict}
            for r in c.rows
        ],
        "skipped": [asdict(s) for s in c.skipped],
    }


def lower_is_better(metric: str) -> bool:
    """Whether a smaller value of `metric` is the better one (nll, perplexity, error...)."""
    name = metric.lower()
    # Whole words of the name: "answer_match" holds "wer" as letters, not as a word.
    words = re.split(r"[^a-z0-9]+", name)
    return any(word in _LOWER_IS_BETTER for word in words)


def verdict(result: PairedDifference, *, confidence: float, lower_better: bool) -> str:
    """One line: which side is better at significance level 1 - confidence, or neither."""
    if result.p_value >= 1.0 - confidence or result.diff == 0:
        return f"no significant difference (p={_p(result.p_value)})"
    b_better = (result.diff < 0) if lower_better else (result.diff > 0)
    return f"{'B' if b_better else 'A'} better (p={_p(result.p_value)})"


def _compare_task(comparison: Comparison, task: str, keys: list, a: Results, b: Results) -> None:
    metrics_a = {m for key in keys for m in a.scores[key]}
    metrics_b = {m for key in keys for m in b.scores[key]}
    for metric in sorted(metrics_a | metrics_b):
        if metric not in metrics_b or metric not in metrics_a:
            side, other = ("A", "B") if metric in metrics_a else ("B", "A")
            reason = f"only {side} has this metric; {other} did not score it"
            comparison.skipped.append(Skipped(task, metric, reason))
            continue
        pairs = [
            (a.scores[k][metric], b.scores[k][metric])
            for k in keys
            if metric in a.scores[k] and metric in b.scores[k]
        ]
        if not pairs:
            reason = "A and B scored it on different samples, none on both"
            comparison.skipped.append(Skipped(task, metric, reason))
            continue
        _add_row(comparison, task, metric, pairs)


def _add_row(comparison: Comparison, task: str, metric: str, pairs: list) -> None:
    first, second = zip(*pairs, strict=True)
    result = paired_difference(
        first,
        second,
        confidence=comparison.confidence,
        resamples=comparison.resamples,
        seed=comparison.seed,
    )
    lower = lower_is_better(metric)
    text = verdict(result, confidence=comparison.confidence, lower_better=lower)
    comparison.rows.append(MetricComparison(task, metric, result, lower, text))


def _task_matches(a: Results, b: Results) -> list[TaskMatch]:
    ids_a, ids_b = _ids_by_task(a), _ids_by_task(b)
    matches = []
    for task in sorted(ids_a.keys() | ids_b.keys()):
        first, second = ids_a.get(task, set()), ids_b.get(task, set())
        both = len(first & second)
        matches.append(TaskMatch(task, both, len(first) - both, len(second) - both))
    return matches


def _ids_by_task(results: Results) -> dict[str, set[str]]:
    ids: dict[str, set[str]] = {}
    for task, sample_id in results.scores:
        ids.setdefault(task, set()).add(sample_id)
    return ids


def _results_folder(folder) -> Path:
    """The folder holding predictions.jsonl that `folder` names; ConfigError when none."""
    path = Path(folder).expanduser()
    if path.is_file() and path.name == PREDICTIONS:
        return path.parent
    if not path.exists():
        raise ConfigError(
            f"evaluation results folder {folder} does not exist: pass the folder a finished "
            "`swiftlm eval` run wrote (its --eval_output_dir)"
        )
    if not path.is_dir():
        raise ConfigError(f"{folder} is a file: pass the folder that holds its {PREDICTIONS}")
    if (path / PREDICTIONS).is_file():
        return path
    runs = sorted(
        (p.parent for p in path.glob(f"eval/*/{PREDICTIONS}") if p.is_file()),
        key=lambda p: ((p / PREDICTIONS).stat().st_mtime, p.name),
    )
    if runs:
        return runs[-1]
    raise ConfigError(
        f"{folder} has no {PREDICTIONS} (nor {folder}/eval/*/{PREDICTIONS}): pass the "
        f"--eval_output_dir of a `swiftlm eval` run (it writes {PREDICTIONS}, {SUMMARY} and "
        f"{MANIFEST} there) or a run directory that was evaluated"
    )


def _read_predictions(path: Path) -> dict[tuple[str, str], dict[str, float]]:
    scores: dict[tuple[str, str], dict[str, float]] = {}
    first_line: dict[tuple[str, str], int] = {}
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            key, values = _parse_line(line, f"{path}:{number}")
            if key in scores:
                raise DataError(
                    f"{path}:{number}: sample {key[1]!r} of task {key[0]!r} is already on line "
                    f"{first_line[key]}; each (task, id) must appear once: rerun the evaluation"
                )
            scores[key], first_line[key] = values, number
    if not scores:
        raise DataError(f"{path} is empty: the evaluation did not finish; rerun `swiftlm eval`")
    return scores


def _parse_line(line: str, where: str) -> tuple[tuple[str, str], dict[str, float]]:
    """(task, id) and the numeric scores of one predictions line; DataError naming `where`."""
    fix = "rerun the evaluation to rewrite the file"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not valid JSON ({exc.msg}); {fix}") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}; {fix}")
    task, sample_id, scores = record.get("task"), record.get("id"), record.get("scores")
    if not isinstance(task, str) or not isinstance(sample_id, (str, int)):
        raise DataError(f"{where}: needs a string 'task' and a string 'id'; {fix}")
    if not isinstance(scores, dict):
        raise DataError(f"{where}: 'scores' must be an object of metric -> number; {fix}")
    values = {}
    for metric, value in scores.items():
        if value is None:  # the metric does not apply to this sample (e.g. no reference)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DataError(f"{where}: score {metric!r} is {value!r}, not a number; {fix}")
        values[metric] = float(value)
    return (task, str(sample_id)), values


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not valid JSON ({exc}); rerun the evaluation") from None
    return data if isinstance(data, dict) else None


def _task_list(results: Results) -> str:
    tasks = sorted({task for task, _ in results.scores})
    return ", ".join(tasks[:5]) + (", ..." if len(tasks) > 5 else "")


def _unmatched_lines(tasks: list[TaskMatch]) -> list[str]:
    partial = [t for t in tasks if t.only_a or t.only_b]
    if not partial:
        return []
    lines = ["", "Samples in only one evaluation (not compared):"]
    for t in partial:
        lines.append(f"  {t.task}: {t.matched} in both, {t.only_a} only in A, {t.only_b} only in B")
    return lines


def _aligned(table: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    lines = []
    for row in table:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)]
        lines.append("  ".join(cells + [row[-1]]).rstrip())
    return lines


def _model(description: str | None) -> str:
    return f" ({description})" if description else ""


def _num(value: float) -> str:
    return f"{value:.4f}"


def _signed(value: float) -> str:
    return f"{value:+.4f}"


def _p(value: float) -> str:
    return f"{value:.3f}" if value >= 0.001 else f"{value:.1e}"
