"""The report as a list of cards: each card is a plot (a figure to draw) or a block of HTML (a
table, a config), in a named group, or a note that the run did not record it.

One list serves both the static `report.html` and the live dashboard, which sends the same
cards again when the run directory changes; so a card's name must be stable (it is the plot's
`data-plot` marker and the element id the live page updates in place).
"""

import hashlib
import html
import json
from collections.abc import Callable
from dataclasses import dataclass

import plotly.graph_objects as go

from swiftlm.report import figures as figs
from swiftlm.report.run_data import RunData, is_eval_key, is_number
from swiftlm.report.tables import (
    anomalies_table,
    config_table,
    data_health_tables,
    histograms_in,
    summary_table,
)

MISSING = "not recorded in this run"

# (group id, heading) in page order.
GROUPS = (
    ("summary", "Run summary"),
    ("training", "Training"),
    ("step_time", "Where the step time goes"),
    ("distributed", "Distributed"),
    ("gradients", "Gradient health"),
    ("moe", "Mixture of experts"),
    ("anomalies", "Anomalies"),
    ("data_health", "Data health"),
    ("method", "Method metrics"),
    ("profile", "Profiler"),
    ("config", "Config"),
)

# Training-row keys that have their own plot or table; every other number is a method metric.
KNOWN_KEYS = {
    "step",
    "epoch",
    "loss",
    "learning_rate",
    "grad_norm",
    "tokens_per_second",
    "label_tokens",
    "memory_gib",
    "elapsed_s",
    "mfu",
    "compute_efficiency",
    "goodput",
    "communication_efficiency",
    "comm_hidden_share",
    "comm_bus_gbps",
    "skipped_steps",
    "anomalies",  # a count; the anomalies themselves are in their table and on the curves
    "eval_loss",
}


@dataclass
class Card:
    """`figure` set: a plot card; else `body` is its HTML (a table) or None (not recorded)."""

    name: str
    group: str
    title: str
    figure: dict | None = None
    body: str | None = None
    note: str = ""

    def _parts(self) -> tuple[str, str, str]:
        """(kind, inner markup, digest); a plot card holds an empty div the page draws into."""
        name = html.escape(self.name, quote=True)
        note = f'<p class="note">{html.escape(self.note)}</p>' if self.note else ""
        if self.figure is not None:
            # The div has the figure's height: plotly then fills it, and the card fits it.
            height = int(self.figure.get("layout", {}).get("height") or 320)
            inner = f'<div class="plot" data-plot="{name}" style="height: {height}px"></div>'
            kind = "plot"
        elif self.body is not None:
            inner, kind = self.body, "html"
        else:
            inner = f'<p class="missing" data-missing="{name}">{MISSING}</p>'
            kind = "missing"
        content = f"<h3>{html.escape(self.title)}</h3>{note}{inner}"
        # The live page replaces a card only when this changes; a plot is redrawn in place.
        return kind, content, hashlib.sha1(f"{kind}{content}".encode()).hexdigest()[:16]

    def html(self) -> str:
        kind, content, digest = self._parts()
        name = html.escape(self.name, quote=True)
        return (
            f'<div class="card {kind}" id="card-{name}" data-card="{name}" '
            f'data-hash="{digest}">{content}</div>'
        )

    def payload(self) -> dict:
        """What the live page needs to place and update this card."""
        return {
            "name": self.name,
            "group": self.group,
            "html": self.html(),
            "hash": self._parts()[2],
        }


def plot_card(name, group, title, fig: go.Figure | None, note: str = "") -> Card:
    return Card(name, group, title, fig.to_plotly_json() if fig is not None else None, note=note)


# name -> (group, title, builder, note) of the fixed plots, in page order.
PLOTS: dict[str, tuple[str, str, Callable[[list[RunData]], go.Figure | None], str]] = {
    "loss": ("training", "Loss (train and eval)", figs.loss_figure, ""),
    "learning_rate": (
        "training",
        "Learning rate",
        lambda runs: figs.line_figure(runs, ("learning_rate",), "learning rate"),
        "",
    ),
    "grad_norm": ("training", "Gradient norm", figs.grad_norm_figure, ""),
    "tokens_per_second": (
        "training",
        "Throughput",
        lambda runs: figs.line_figure(runs, ("tokens_per_second",), "tokens/s", zero=True),
        "",
    ),
    "mfu": (
        "training",
        "Compute efficiency (MFU)",
        lambda runs: figs.line_figure(runs, ("compute_efficiency", "mfu"), "MFU", percent=True),
        "",
    ),
    "memory": (
        "training",
        "Memory",
        lambda runs: figs.line_figure(runs, ("memory_gib",), "GiB", zero=True),
        "Peak memory of the process: the CUDA allocator on GPU, resident set on CPU.",
    ),
    "step_time": (
        "step_time",
        "Step time by phase (stacked)",
        figs.step_time_figure,
        "Each band is one phase's mean seconds per step over the logged window.",
    ),
    "goodput": (
        "step_time",
        "Goodput",
        lambda runs: figs.line_figure(runs, ("goodput",), "compute / wall time", percent=True),
        "Share of the wall time spent computing (forward, backward, optimizer).",
    ),
    "communication": (
        "distributed",
        "Communication efficiency and hidden share",
        figs.communication_figure,
        "Achieved bus bandwidth over the link's measured peak; share of communication "
        "overlapped by compute.",
    ),
    "comm_bandwidth": (
        "distributed",
        "Bus bandwidth",
        lambda runs: figs.line_figure(runs, ("comm_bus_gbps",), "GB/s", zero=True),
        "",
    ),
    "rank_step_time": (
        "distributed",
        "Step time per rank",
        figs.rank_step_figure,
        "A straggler rank shows as one bright row.",
    ),
    "rank_utilization": (
        "distributed",
        "Device utilization per rank",
        figs.rank_utilization_figure,
        "Busy share of each rank's device (GPU) or CPU.",
    ),
    "grad_norm_layers": (
        "gradients",
        "Gradient norm by layer group (log colour)",
        figs.grad_norm_heatmap,
        "Input layers at the bottom; a dark band is vanishing gradients, a bright one exploding.",
    ),
    "grad_histograms": (
        "gradients",
        "Latest gradient histograms",
        figs.histogram_figure,
        "Distribution of log10|gradient| per layer group at the latest histogram step.",
    ),
}


# name -> (title, builder, note) of the router plots, shown for runs of MoE models.
ROUTER_PLOTS: dict[str, tuple[str, Callable[[list[RunData]], go.Figure | None], str]] = {
    "router_load": (
        "Load per expert (latest window)",
        figs.router_load_heatmap,
        "Share of routed slots x experts: 1 is an even load, a bright cell an overloaded "
        "expert, a dark one an expert the router starves.",
    ),
    "router_load_max": (
        "Most loaded expert",
        lambda runs: figs.line_figure(runs, ("router_load_max",), "share x experts", zero=True),
        "The largest expert share of any layer times the number of experts (1 = even).",
    ),
    "router_entropy": (
        "Router entropy",
        lambda runs: figs.line_figure(runs, ("router_entropy",), "nats", zero=True),
        "Mean entropy of the routers' distributions: log(experts) is uniform, 0 is one expert.",
    ),
    "router_aux_loss": (
        "Load-balancing loss",
        lambda runs: figs.line_figure(runs, ("router_aux_loss",), "aux loss"),
        "transformers' load-balancing loss (top_k when the load is even); trained with "
        "--router_aux_loss_coef > 0.",
    ),
    "router_z_loss": (
        "Router z loss",
        lambda runs: figs.line_figure(runs, ("router_z_loss",), "z loss", zero=True),
        "Mean squared log-sum-exp of the router logits (ST-MoE); large values mean logits "
        "growing without bound. Logged, not trained.",
    ),
}


def router_cards(runs: list[RunData]) -> list[Card]:
    """The router plots, for runs of mixture-of-experts models only."""
    if not any("router_entropy" in row for run in runs for row in run.train):
        return []
    return [
        plot_card(name, "moe", title, build(runs), note)
        for name, (title, build, note) in ROUTER_PLOTS.items()
    ]


def method_keys(runs: list[RunData]) -> list[str]:
    """Numeric keys without a plot of their own (a method's rewards, KL, eval metrics ...), in
    the order first logged."""
    keys: list[str] = []
    for run in runs:
        for row in run.train + run.eval:
            for key, value in row.items():
                plain = key not in KNOWN_KEYS and not key.startswith(("time/", "share/", "router_"))
                if plain and is_number(value) and key not in keys:
                    keys.append(key)
    return keys


def method_cards(runs: list[RunData]) -> list[Card]:
    keys = method_keys(runs)
    if not keys:
        return [Card("method", "method", "Method metrics")]
    cards = []
    for key in keys:
        source = "eval" if is_eval_key(key) else "train"
        view = [RunData(r.name, r.path, train=getattr(r, source)) for r in runs]
        cards.append(plot_card(f"method:{key}", "method", key, figs.line_figure(view, (key,))))
    return cards


def data_health_cards(runs: list[RunData]) -> list[Card]:
    """Per run: its scalars as one table card, each {"edges", "counts"} as a bar chart card."""
    cards = []
    for run in runs:
        if run.data_health is None:
            continue
        prefix = f"{run.name}: " if len(runs) > 1 else ""
        suffix = f":{run.name}" if len(runs) > 1 else ""
        body = data_health_tables(run.data_health)
        if body:
            cards.append(Card(f"data_health{suffix}", "data_health", f"{prefix}summary", body=body))
        for path, histogram in histograms_in(run.data_health):
            fig = figs.histogram_bars(histogram)
            name = f"data_health:{path}{suffix}"
            cards.append(plot_card(name, "data_health", f"{prefix}{path}", fig))
    return cards or [Card("data_health", "data_health", "Data health summary")]


def text_cards(runs: list[RunData]) -> list[Card]:
    """The run summary, anomalies, profiler and config cards."""
    cards = [Card("summary", "summary", "Run summary", body=summary_table(runs))]
    has_anomalies = any(run.anomalies for run in runs)
    cards.append(
        Card(
            "anomalies",
            "anomalies",
            "Flagged anomalies",
            body=anomalies_table(runs) if has_anomalies else "<p>No anomaly was flagged.</p>",
        )
    )
    operators = [run for run in runs if run.top_operators]
    body = "".join(
        (f"<h4>{html.escape(run.name)}</h4>" if len(runs) > 1 else "")
        + f"<pre>{html.escape(run.top_operators or '')}</pre>"
        for run in operators
    )
    cards.append(Card("profile", "profile", "Top operators (--profile)", body=body or None))
    title = "Config (keys that differ between the runs)" if len(runs) > 1 else "Config"
    cards.append(Card("config", "config", title, body=config_table(runs)))
    return cards


def build_cards(runs: list[RunData]) -> list[Card]:
    """Every card of the report, in page order."""
    cards = text_cards(runs)
    for name, (group, title, build, note) in PLOTS.items():
        cards.append(plot_card(name, group, title, build(runs), note))
    cards += router_cards(runs)
    cards += data_health_cards(runs)
    cards += method_cards(runs)
    order = [group for group, _ in GROUPS]
    return sorted(cards, key=lambda card: order.index(card.group))


def figures_json(cards: list[Card]) -> str:
    """{card name: figure} of the plot cards, as JSON safe inside a <script> element."""
    from plotly.utils import PlotlyJSONEncoder

    figures = {card.name: card.figure for card in cards if card.figure is not None}
    return json.dumps(figures, cls=PlotlyJSONEncoder).replace("</", "<\\/")
