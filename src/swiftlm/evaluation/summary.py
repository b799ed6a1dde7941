"""A task's summary: every metric's mean with its bootstrap interval (a perplexity task's
`perplexity` too, a ratio over the whole task: `perplexity.perplexity_interval`), and the
terminal table of an evaluation's summaries."""

from swiftlm.evaluation.perplexity import perplexity_interval
from swiftlm.evaluation.runner import TaskRun
from swiftlm.evaluation.stats import bootstrap_interval


def summarize(run: TaskRun, confidence: float, resamples: int, seed: int) -> dict:
    metrics = {}
    names = sorted({name for record in run.records for name in record["scores"]})
    for name in names:
        values = [r["scores"][name] for r in run.records if name in r["scores"]]
        interval = bootstrap_interval(values, confidence=confidence, resamples=resamples, seed=seed)
        metrics[name] = {
            "mean": interval.mean,
            "low": interval.low,
            "high": interval.high,
            "confidence": confidence,
            "n": len(values),
        }
    if run.task.kind == "perplexity":
        metrics["perplexity"] = perplexity_interval(run.records, confidence, resamples, seed)
    return {
        "kind": run.task.kind,
        "n": len(run.records),
        "source": run.task.source,
        "seconds": round(run.seconds, 3),
        "metrics": metrics,
    }


def format_summary(summary: dict) -> str:
    """The terminal table: task, metric, value and interval, samples, seconds."""
    lines = [f"{'task':<24} {'metric':<14} {'value':>8}  {'95% interval':<19} {'n':>5} {'s':>7}"]
    for task, result in summary.items():
        for metric, value in result["metrics"].items():
            level = round(value["confidence"] * 100)
            interval = f"[{_fmt(value['low'])}, {_fmt(value['high'])}]"
            lines.append(
                f"{task:<24} {metric:<14} {_fmt(value['mean']):>8}  {interval:<19} "
                f"{value['n']:>5} {result['seconds']:>7.1f}"
            )
        lines[0] = lines[0].replace("95%", f"{level}%") if result["metrics"] else lines[0]
    return "\n".join(lines)


def _fmt(value: float) -> str:
    return f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"
