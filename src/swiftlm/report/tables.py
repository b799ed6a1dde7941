"""The report's HTML tables: run summary, anomalies, data health, config and config diff.

Plain escaped HTML strings, built by small functions; all values go through `cell` so that
numbers read the same everywhere and nothing from a run directory is injected as markup.
"""

import html
from typing import Any

import yaml

from swiftlm.monitor.metrics import SUMMARY_LABELS
from swiftlm.report.run_data import RunData, is_number


def cell(value: Any) -> str:
    """A value as table text: 4 significant digits for floats, lists joined, escaped."""
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value):
        text = ", ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in value)
    elif value is None:
        text = "—"
    else:
        text = str(value)
    return html.escape(text)


def table(header: list[str], rows: list[list[Any]], css: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def summary_from_metrics(run: RunData) -> dict:
    """What the metrics say when summary.json is absent (a run still going, or killed)."""
    out: dict[str, Any] = {}
    if run.train:
        last = run.train[-1]
        out["steps"] = last["step"]
        out["train_time_s"] = last.get("elapsed_s")
        rates = [r["tokens_per_second"] for r in run.train if is_number(r.get("tokens_per_second"))]
        out["tokens_per_second"] = sum(rates) / len(rates) if rates else None
        memory = [r["memory_gib"] for r in run.train if is_number(r.get("memory_gib"))]
        out["peak_memory_gib"] = max(memory) if memory else None
        out["final_train_loss"] = last.get("loss")
        out["skipped_steps"] = last.get("skipped_steps")
    if run.eval:
        out["final_eval_loss"] = run.eval[-1].get("eval_loss")
    return {k: v for k, v in out.items() if v is not None}


def summary_table(runs: list[RunData]) -> str:
    """One column per run: summary.json where the run finished, else read off its metrics."""
    summaries = [run.summary or summary_from_metrics(run) for run in runs]
    keys = [k for k in SUMMARY_LABELS if any(k in s for s in summaries)]
    keys += [k for s in summaries for k in s if k not in keys and not isinstance(s[k], dict)]
    keys = list(dict.fromkeys(keys))
    rows = [["run directory", *[str(run.path) for run in runs]]]
    rows.append(["status", *["finished" if r.summary else "running or stopped" for r in runs]])
    rows.append(["latest step", *[run.latest_step() for run in runs]])
    rows += [[SUMMARY_LABELS.get(k, k), *[s.get(k) for s in summaries]] for k in keys]
    return table(["", *[run.name for run in runs]], rows, "summary")


def anomalies_table(runs: list[RunData]) -> str:
    several = len(runs) > 1
    header = (["run"] if several else []) + ["step", "kind", "value", "median", "factor", "message"]
    rows = []
    for run in runs:
        for a in run.anomalies:
            fields = [a.get(k) for k in ("step", "kind", "value", "median", "factor", "message")]
            rows.append(([run.name] if several else []) + fields)
    return table(header, rows, "anomalies")


def is_histogram(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("edges"), list) and "counts" in value


def histograms_in(data: dict, prefix: str = "") -> list[tuple[str, dict]]:
    """(dotted path, histogram) of every {"edges", "counts"} dict nested in `data`."""
    found = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if is_histogram(value):
            found.append((path, value))
        elif isinstance(value, dict):
            found += histograms_in(value, f"{path}.")
    return found


def _health_rows(data: dict, prefix: str = "") -> list[str]:
    """Scalars as key/value rows; each nested dict as a heading row then its own rows."""
    rows, nested = [], []
    for key, value in data.items():
        if is_histogram(value):
            continue  # drawn as a bar chart
        if isinstance(value, dict):
            nested.append((key, value))
        else:
            rows.append(f"<tr><td>{html.escape(str(key))}</td><td>{cell(value)}</td></tr>")
    for key, value in nested:
        inner = _health_rows(value, f"{prefix}{key}.")
        if inner:
            heading = html.escape(f"{prefix}{key}")
            rows.append(f'<tr class="section"><th colspan="2">{heading}</th></tr>')
            rows += inner
    return rows


def data_health_tables(data: dict) -> str:
    rows = _health_rows(data)
    return f'<table class="health"><tbody>{"".join(rows)}</tbody></table>' if rows else ""


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1}} -> {"train.lr": 1}."""
    if not isinstance(data, dict):
        return {prefix.rstrip("."): data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}{key}."))
    return out


def config_diff(configs: list[dict]) -> list[list[Any]]:
    """[key, value in run 1, value in run 2, ...] for the keys whose values differ."""
    flat = [flatten(c) for c in configs]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    missing = object()
    rows = []
    for key in keys:
        values = [f.get(key, missing) for f in flat]
        if any(v != values[0] for v in values[1:]):
            rows.append([key, *["(absent)" if v is missing else v for v in values]])
    return rows


def config_yaml(config: dict) -> str:
    text = yaml.safe_dump(config, sort_keys=False, allow_unicode=True)
    return f"<pre>{html.escape(text)}</pre>"


def config_table(runs: list[RunData]) -> str | None:
    """One run: its config.yaml. Several: the keys that differ, then each full config folded."""
    if len(runs) == 1:
        return config_yaml(runs[0].config) if runs[0].config else None
    if not any(run.config for run in runs):
        return None
    rows = config_diff([run.config or {} for run in runs])
    diff = (
        table(["key", *[run.name for run in runs]], rows, "config-diff")
        if rows
        else "<p>The configs are the same.</p>"
    )
    folded = "".join(
        f"<details><summary>{html.escape(run.name)}: config.yaml</summary>"
        f"{config_yaml(run.config) if run.config else '<p>no config.yaml</p>'}</details>"
        for run in runs
    )
    return diff + folded
