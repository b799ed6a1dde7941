"""The report's plotly figures, one small builder each, from parsed run directories.

Each builder takes the runs (one, or several to overlay: one trace per run, named by its run
directory) and returns a `go.Figure`, or None when no run recorded the data, so the page can
say "not recorded in this run" instead of drawing an empty plot. Heatmaps cannot overlay, so
with several runs they stack one row per run.
"""

import math
from collections.abc import Callable

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from swiftlm.monitor.step_time import PHASES as STEP_PHASES
from swiftlm.report.run_data import RunData, finite, is_number

# The step-time phases in the order a step runs them (step_time.PHASES); stacked bottom to
# top, with what no phase covered on top.
PHASES = (*STEP_PHASES, "other")
PHASE_COLORS = dict(
    zip(
        PHASES,
        (
            "#9e9e9e",
            "#1f77b4",
            "#ff7f0e",
            "#2ca02c",
            "#d62728",
            "#8c564b",
            "#e377c2",
            "#17becf",
            "#bcbd22",
            "#aec7e8",
            "#ffbb78",
            "#c7c7c7",
        ),
        strict=True,
    )
)
RUN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b")
ANOMALY_KINDS = {"loss": ("loss_spike", "nonfinite"), "grad_norm": ("grad_norm_spike", "nonfinite")}


def run_color(index: int) -> str:
    return RUN_COLORS[index % len(RUN_COLORS)]


def base_layout(
    fig: go.Figure, y_title: str = "", percent: bool = False, log: bool = False, zero=False
):
    """One look for every plot: white, compact, legend above, hover across traces."""
    fig.update_layout(
        template="plotly_white",
        height=320,
        # The legend goes under the plot: above it, it would run under plotly's tool bar.
        margin=dict(l=60, r=20, t=30, b=40),
        legend=dict(orientation="h", yanchor="top", y=-0.22, x=0),
        hovermode="x unified",
    )
    fig.update_xaxes(title_text="step", title_standoff=4)
    fig.update_yaxes(title_text=y_title, type="log" if log else None)
    if percent:  # up to 3 decimals, trimmed: a CPU MFU of 0.05% must not read "0%"
        fig.update_yaxes(tickformat=".3~%")
    if percent or zero:  # a rate or share from zero: a flat line is not blown up into noise
        fig.update_yaxes(rangemode="tozero")
    return fig


def column(rows: list[dict], key: str) -> tuple[list[int], list[float | None]]:
    """(steps, values) of the rows holding a number under `key`; non-finite values as gaps."""
    pairs = [(row["step"], finite(row[key])) for row in rows if is_number(row.get(key))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def line_figure(
    runs: list[RunData], keys: tuple[str, ...], y_title="", percent=False, log=False, zero=False
) -> go.Figure | None:
    """Training-row keys over steps: the first key found in a run's rows is its curve (a key
    and its older alias, e.g. compute_efficiency then mfu)."""
    fig = go.Figure()
    for index, run in enumerate(runs):
        key = next((k for k in keys if any(is_number(r.get(k)) for r in run.train)), None)
        if key is None:
            continue
        steps, values = column(run.train, key)
        name = run.name if len(runs) > 1 else key
        # Sparse rows (evaluation) get markers: a line between two points hides how few there are.
        mode = "lines+markers" if len(steps) <= 20 else "lines"
        fig.add_scatter(x=steps, y=values, name=name, mode=mode, line_color=run_color(index))
    if not fig.data:
        return None
    return base_layout(fig, y_title, percent, log, zero)


def anomaly_markers(fig: go.Figure, runs: list[RunData], key: str) -> None:
    """Flagged steps of `key`'s kinds as red crosses on its curve, the message on hover."""
    for run in runs:
        flagged = [a for a in run.anomalies if a.get("kind") in ANOMALY_KINDS[key]]
        if not flagged:
            continue
        ys = [finite(a.get("value")) for a in flagged]
        # A NaN loss has no height: mark it at the running median it was compared with.
        ys = [
            y if y is not None else finite(a.get("median"))
            for y, a in zip(ys, flagged, strict=True)
        ]
        fig.add_scatter(
            x=[a["step"] for a in flagged],
            y=ys,
            mode="markers",
            name=f"{run.name}: anomalies" if len(runs) > 1 else "anomalies",
            marker=dict(symbol="x", size=11, color="#d62728", line=dict(width=2)),
            text=[str(a.get("message", a.get("kind"))) for a in flagged],
            hovertemplate="%{text}<extra></extra>",
        )


def loss_figure(runs: list[RunData]) -> go.Figure | None:
    """Train loss as lines, eval loss as dashed lines with markers, in the run's colour."""
    fig = go.Figure()
    for index, run in enumerate(runs):
        prefix = f"{run.name}: " if len(runs) > 1 else ""
        color = run_color(index)
        steps, values = column(run.train, "loss")
        if steps:
            fig.add_scatter(x=steps, y=values, name=f"{prefix}train", line_color=color)
        steps, values = column(run.eval, "eval_loss")
        if steps:
            fig.add_scatter(
                x=steps,
                y=values,
                name=f"{prefix}eval",
                mode="lines+markers",
                line=dict(color=color, dash="dash"),
            )
    if not fig.data:
        return None
    anomaly_markers(fig, runs, "loss")
    return base_layout(fig, "loss")


def grad_norm_figure(runs: list[RunData]) -> go.Figure | None:
    fig = line_figure(runs, ("grad_norm",), "gradient norm")
    if fig is not None:
        anomaly_markers(fig, runs, "grad_norm")
    return fig


def phases_of(run: RunData) -> list[str]:
    """The phases a run timed (`time/<phase>_s`): known ones in step order, then new ones."""
    found = []
    for row in run.train:
        for key in row:
            if key.startswith("time/") and key.endswith("_s") and key != "time/step_s":
                phase = key[len("time/") : -len("_s")]
                if phase not in found:
                    found.append(phase)
    known = [p for p in PHASES if p in found and p != "other"]
    others = [p for p in found if p not in PHASES] + (["other"] if "other" in found else [])
    return known + others  # `other` (the remainder) stays on top


def step_time_traces(run: RunData, first: bool) -> list[go.Scatter]:
    """One run's phases as stacked areas, and its measured step time as a dotted line: the
    stack reaching the line means the phases cover the step. `first`: shown in the legend
    (phase colours are the same in every run's panel)."""
    traces = []
    for phase in phases_of(run):
        steps, values = column(run.train, f"time/{phase}_s")
        _, shares = column([r for r in run.train if f"time/{phase}_s" in r], f"share/{phase}")
        traces.append(
            go.Scatter(
                x=steps,
                y=values,
                name=phase,
                stackgroup=run.name,
                legendgroup=phase,
                showlegend=first,
                line=dict(width=0.5, color=PHASE_COLORS.get(phase)),
                customdata=shares if len(shares) == len(steps) else None,
                hovertemplate="%{y:.3f} s" + (" (%{customdata:.0%})" if shares else ""),
            )
        )
    steps, values = column(run.train, "time/step_s")
    if steps:
        line = dict(color="black", dash="dot")
        traces.append(
            go.Scatter(
                x=steps,
                y=values,
                name="step (measured)",
                mode="lines",
                line=line,
                legendgroup="step",
                showlegend=first,
            )
        )
    return traces


def step_time_figure(runs: list[RunData]) -> go.Figure | None:
    """Seconds per step by phase, stacked; several runs get one panel each (stacks cannot
    overlay)."""
    panels = []
    for run in runs:
        traces = step_time_traces(run, first=not panels)
        if traces:
            panels.append((run.name, traces))
    return panel_figure(panels, "seconds per step", len(runs) > 1)


def log_colorbar(low: float, high: float) -> dict:
    """Colour-bar ticks of a log10-valued heatmap, labelled with the values themselves: whole
    decades when the range spans two or more, else five ticks across it."""
    if math.ceil(high) - math.floor(low) >= 2:
        ticks = [float(t) for t in range(math.ceil(low), math.floor(high) + 1)]
    else:
        ticks = [low + (high - low) * k / 4 for k in range(5)] if high > low else [low]
    return dict(tickvals=ticks, ticktext=[f"{10**t:.3g}" for t in ticks], title="norm")


def panel_figure(panels: list[tuple[str, list]], y_title: str, several: bool, x_title="step"):
    """One row per (title, traces) panel, titled when there are several runs; None if none.
    Only the bottom panel names the x axis: the next panel's title sits where it would be."""
    if not panels:
        return None
    fig = make_subplots(
        rows=len(panels),
        cols=1,
        subplot_titles=[title for title, _ in panels] if several else None,
        vertical_spacing=min(0.12, 0.5 / len(panels)),
    )
    for row, (_, traces) in enumerate(panels, start=1):
        for trace in traces:
            fig.add_trace(trace, row=row, col=1)
    base_layout(fig, y_title)
    fig.update_xaxes(title_text="")
    fig.update_xaxes(title_text=x_title, row=len(panels), col=1)
    fig.update_layout(height=max(320, 260 * len(panels)))
    return fig


def share_colour_scale(heatmaps: list[go.Heatmap], colorbar: Callable | None = None) -> None:
    """One colour scale for every panel (else equal colours would mean different values), and
    one colour bar."""
    values = [v for h in heatmaps for line in h.z for v in line if v is not None]
    if not values:
        return
    low, high = min(values), max(values)
    for index, heatmap in enumerate(heatmaps):
        if heatmap.zmin is None:  # a fixed range (a 0..1 share) stays
            heatmap.zmin, heatmap.zmax = low, high
        heatmap.showscale = index == 0
        if colorbar is not None:
            heatmap.colorbar = colorbar(low, high)


def rows_of_heatmaps(
    runs: list[RunData],
    build: Callable[[RunData], go.Heatmap | None],
    y_title: str,
    colorbar: Callable | None = None,
    x_title: str = "step",
) -> go.Figure | None:
    """One heatmap per run that has the data, stacked vertically, on one colour scale."""
    traces = [(run, build(run)) for run in runs]
    traces = [(run, trace) for run, trace in traces if trace is not None]
    share_colour_scale([trace for _, trace in traces], colorbar)
    panels = [
        (f"{run.name} ({trace.name})" if trace.name else run.name, [trace]) for run, trace in traces
    ]
    fig = panel_figure(panels, y_title, len(runs) > 1, x_title)
    if fig is not None:
        fig.update_layout(hovermode="closest")
    return fig


def layer_groups(rows: list[dict], key: str) -> list[str]:
    """The layer groups of a nested per-group metric, in the order logged (input to output)."""
    groups: list[str] = []
    for row in rows:
        value = row.get(key)
        if isinstance(value, dict):
            groups += [g for g in value if g not in groups]
    return groups


def grad_norm_heatmap_trace(run: RunData) -> go.Heatmap | None:
    """log10 of each layer group's gradient norm (y, input at the bottom) over steps (x)."""
    rows = [r for r in run.train if isinstance(r.get("grad_norm_layers"), dict)]
    groups = layer_groups(rows, "grad_norm_layers")
    if not groups:
        return None
    norms = [[finite(r["grad_norm_layers"].get(g)) for r in rows] for g in groups]
    z = [[math.log10(v) if v and v > 0 else None for v in line] for line in norms]
    return go.Heatmap(
        x=[r["step"] for r in rows],
        y=groups,
        z=z,
        customdata=norms,
        colorscale="Viridis",
        hovertemplate="step %{x}<br>%{y}: %{customdata:.3g}<extra></extra>",
    )


def grad_norm_heatmap(runs: list[RunData]) -> go.Figure | None:
    return rows_of_heatmaps(runs, grad_norm_heatmap_trace, "layer group", log_colorbar)


def router_load_trace(run: RunData) -> go.Heatmap | None:
    """Each MoE layer's share of routed slots per expert (x) in the last logged window;
    colour = share x experts, so 1 is an even load whatever the number of experts."""
    rows = [r for r in run.train if isinstance(r.get("router_expert_load"), dict)]
    if not rows:
        return None
    layers = rows[-1]["router_expert_load"]
    shares = [[finite(v) for v in layers[name]] for name in layers]
    experts = max(len(line) for line in shares)
    return go.Heatmap(
        x=list(range(experts)),
        y=list(layers),
        z=[[v * experts if v is not None else None for v in line] for line in shares],
        customdata=shares,
        zmin=0,
        colorscale="Viridis",
        name=f"step {rows[-1]['step']}",
        hovertemplate="expert %{x}, %{y}: %{customdata:.1%} of slots<extra></extra>",
    )


def router_load_heatmap(runs: list[RunData]) -> go.Figure | None:
    return rows_of_heatmaps(runs, router_load_trace, "MoE layer", x_title="expert")


def histogram_trace(run: RunData) -> go.Heatmap | None:
    """The latest gradient histogram: bins of log10|g| (x) by layer group (y), colour =
    log10(1 + count) so that thin tails (vanishing or exploding values) still show."""
    if not run.histograms:
        return None
    latest = run.histograms[-1]
    edges, layers = latest.get("edges") or [], latest.get("layers") or {}
    if len(edges) < 2 or not isinstance(layers, dict) or not layers:
        return None
    centres = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:], strict=True)]
    counts = [list(layers[g]) for g in layers]
    return go.Heatmap(
        x=centres,
        y=list(layers),
        z=[
            [math.log10(1 + c) if is_number(c) and c >= 0 else None for c in line]
            for line in counts
        ],
        customdata=counts,
        colorscale="Magma",
        colorbar=dict(title="log10(1+n)"),
        hovertemplate="%{y}<br>log10|g| ≈ %{x:.2f}: %{customdata} values<extra></extra>",
        name=f"step {latest['step']}",
    )


def histogram_figure(runs: list[RunData]) -> go.Figure | None:
    steps = {r.histograms[-1].get("step") for r in runs if r.histograms}
    # One step for all: the axis says which; else each panel's title does.
    at = f" at step {next(iter(steps))}" if len(steps) == 1 else ""
    return rows_of_heatmaps(runs, histogram_trace, "layer group", x_title=f"log10 |gradient|{at}")


def rank_trace(run: RunData, key: str, label: str, zmax: float | None) -> go.Heatmap | None:
    """A per-rank list metric as rank (y) by step (x): a straggler is one bright row."""
    rows = [r for r in run.train if isinstance(r.get(key), list) and r[key]]
    if not rows:
        return None
    ranks = max(len(r[key]) for r in rows)
    z = [[finite(r[key][i]) if i < len(r[key]) else None for r in rows] for i in range(ranks)]
    return go.Heatmap(
        x=[r["step"] for r in rows],
        y=[f"rank {i}" for i in range(ranks)],
        z=z,
        zmin=0 if zmax is not None else None,
        zmax=zmax,
        colorscale="YlOrRd",
        colorbar=dict(title=label),
        hovertemplate="step %{x}, %{y}: %{z:.3g} " + label + "<extra></extra>",
    )


def rank_step_figure(runs: list[RunData]) -> go.Figure | None:
    return rows_of_heatmaps(runs, lambda r: rank_trace(r, "rank_step_s", "s", None), "rank")


def rank_utilization_figure(runs: list[RunData]) -> go.Figure | None:
    return rows_of_heatmaps(runs, lambda r: rank_trace(r, "rank_utilization", "busy", 1.0), "rank")


def communication_figure(runs: list[RunData]) -> go.Figure | None:
    """Achieved over peak bus bandwidth, and the share of communication hidden by compute."""
    fig = go.Figure()
    for index, run in enumerate(runs):
        prefix = f"{run.name}: " if len(runs) > 1 else ""
        for key, dash in (("communication_efficiency", None), ("comm_hidden_share", "dot")):
            steps, values = column(run.train, key)
            if steps:
                line = dict(color=run_color(index), dash=dash)
                fig.add_scatter(x=steps, y=values, name=f"{prefix}{key}", line=line)
    if not fig.data:
        return None
    return base_layout(fig, "share", percent=True)


def histogram_bars(histogram: dict) -> go.Figure | None:
    """A data-health {"edges", "counts"} histogram as bars spanning their bins."""
    edges, counts = histogram.get("edges") or [], histogram.get("counts") or []
    if len(edges) != len(counts) + 1 or not counts:
        return None
    fig = go.Figure(
        go.Bar(
            x=[(a + b) / 2 for a, b in zip(edges[:-1], edges[1:], strict=True)],
            y=counts,
            width=[b - a for a, b in zip(edges[:-1], edges[1:], strict=True)],
            customdata=[[a, b] for a, b in zip(edges[:-1], edges[1:], strict=True)],
            hovertemplate="[%{customdata[0]:.4g}, %{customdata[1]:.4g}): %{y}<extra></extra>",
            marker_color="#1f77b4",
        )
    )
    base_layout(fig, "count")
    fig.update_xaxes(title_text="")
    fig.update_layout(height=260, hovermode="closest", bargap=0.02)
    return fig
