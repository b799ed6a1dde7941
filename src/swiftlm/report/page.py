"""The report page: one self-contained HTML document (CSS, plotly.js and the figures inlined),
so `report.html` opens offline from disk and makes no network request.

The same page is the live dashboard: given `live` settings it also polls `data?since=VERSION`
and, when the run directory changed, updates each card in place (`Plotly.react` keeps the
zoom) and adds or replaces the cards whose markup changed (a section that starts to record).
"""

import html
import json
import time

from swiftlm.report.cards import GROUPS, Card, figures_json

STYLE = """
* { box-sizing: border-box; }
body { font-family: system-ui, -apple-system, Segoe UI, Roboto, sans-serif; margin: 0;
  background: #f5f6f8; color: #222; }
header { position: sticky; top: 0; z-index: 10; background: #1f2937; color: #fff;
  padding: 10px 20px; display: flex; flex-wrap: wrap; gap: 6px 18px; align-items: baseline; }
header h1 { font-size: 18px; margin: 0; }
header .meta { font-size: 13px; color: #cbd5e1; }
header nav a { color: #93c5fd; font-size: 13px; margin-right: 10px; text-decoration: none; }
#live-status.live { color: #4ade80; } #live-status.down { color: #f87171; }
main { padding: 10px 20px 40px; }
section h2 { font-size: 16px; margin: 22px 0 8px; border-bottom: 1px solid #d1d5db; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(min(540px, 100%), 1fr));
  gap: 12px; }
.card { background: #fff; border: 1px solid #e5e7eb; border-radius: 6px; padding: 8px 12px;
  min-width: 0; }
.card h3 { font-size: 14px; margin: 2px 0 4px; }
.card .note { font-size: 12px; color: #6b7280; margin: 0 0 4px; }
.card.missing p.missing { color: #9ca3af; font-style: italic; font-size: 13px; }
.card.html { overflow-x: auto; }
.plot { width: 100%; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border-bottom: 1px solid #eee; padding: 3px 10px; text-align: left;
  vertical-align: top; }
tr.section th { background: #f3f4f6; }
pre { font-size: 12px; background: #f9fafb; padding: 8px; overflow-x: auto; max-height: 480px; }
details summary { cursor: pointer; font-size: 13px; margin-top: 6px; }
"""

SCRIPT = """
const PLOT_CONFIG = {responsive: true, displaylogo: false, displayModeBar: 'hover'};
const LIVE = JSON.parse(document.getElementById('live-settings').textContent);

function plotDiv(name) {
  return document.querySelector('.plot[data-plot="' + CSS.escape(name) + '"]');
}

function draw(figures) {
  const jobs = [];
  for (const [name, fig] of Object.entries(figures)) {
    const div = plotDiv(name);
    if (div) jobs.push(Plotly.react(div, fig.data, fig.layout, PLOT_CONFIG));
  }
  return Promise.all(jobs);
}

function fromHtml(markup) {
  const template = document.createElement('template');
  template.innerHTML = markup.trim();
  return template.content.firstChild;
}

// Put each card where it belongs: unchanged markup stays (its plot is redrawn in place),
// changed markup is replaced, new cards are added, cards no longer sent are removed.
function applyCards(cards) {
  const keep = new Set();
  for (const card of cards) {
    keep.add(card.name);
    const old = document.getElementById('card-' + card.name);
    if (old && old.dataset.hash === card.hash) continue;
    const fresh = fromHtml(card.html);
    if (old) {
      old.querySelectorAll('.plot').forEach((div) => Plotly.purge(div));
      old.replaceWith(fresh);
    } else {
      document.querySelector('section[data-group="' + card.group + '"] .cards').append(fresh);
    }
  }
  document.querySelectorAll('.card').forEach((el) => {
    if (!keep.has(el.dataset.card)) el.remove();
  });
}

function showStep(step) {
  const el = document.getElementById('latest-step');
  el.textContent = step === null ? '—' : String(step);
  el.dataset.step = step === null ? '' : String(step);
}

async function poll(version) {
  let next = version;
  const status = document.getElementById('live-status');
  try {
    const reply = await fetch('data?since=' + encodeURIComponent(version), {cache: 'no-store'});
    if (!reply.ok) throw new Error(await reply.text());  // e.g. a damaged metrics line
    const update = await reply.json();
    if (update.cards) {
      applyCards(update.cards);
      await draw(update.figures);
      showStep(update.latest_step);
      document.getElementById('written').textContent =
        'updated ' + new Date().toLocaleTimeString();
    }
    next = update.version;
    status.textContent = 'live'; status.className = 'live';
  } catch (err) {
    status.textContent = 'not updating (' + err.message + '); retrying';
    status.className = 'down';
  }
  setTimeout(() => poll(next), LIVE.interval_ms);
}

draw(JSON.parse(document.getElementById('figures').textContent)).then(() => {
  document.body.dataset.rendered = 'true';
  if (LIVE) poll(LIVE.version);
});
"""


def group_sections(cards: list[Card]) -> str:
    """One <section> per group, its cards in a grid."""
    parts = []
    for group, heading in GROUPS:
        inner = "".join(card.html() for card in cards if card.group == group)
        parts.append(
            f'<section id="{group}" data-group="{group}"><h2>{html.escape(heading)}</h2>'
            f'<div class="cards">{inner}</div></section>'
        )
    return "".join(parts)


def navigation() -> str:
    return "<nav>" + "".join(f'<a href="#{g}">{html.escape(h)}</a>' for g, h in GROUPS) + "</nav>"


def plotly_js() -> str:
    """plotly.js itself, inlined (a few MB) so the page needs no network; `</script>` inside
    it cannot end our element early."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs().replace("</script", "<\\/script")


def render_page(
    cards: list[Card], names: list[str], latest_step: int | None, live: dict | None = None
) -> str:
    """The whole document. `live`: {"version": str, "interval_ms": int} for the dashboard."""
    title = "swiftlm report: " + ", ".join(names)
    step = "—" if latest_step is None else str(latest_step)
    status = '<span id="live-status">connecting</span>' if live else "<span>static report</span>"
    live_json = json.dumps(live).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{html.escape(title)}</title><style>{STYLE}</style>
<script>{plotly_js()}</script></head>
<body data-rendered="false"><header><h1>{html.escape(title)}</h1>
<span class="meta">latest step <b id="latest-step" data-step="{step}">{step}</b></span>
<span class="meta">{status}</span>
<span class="meta" id="written">written {time.strftime("%Y-%m-%d %H:%M:%S")}</span>{navigation()}</header>
<main>{group_sections(cards)}</main>
<script type="application/json" id="figures">{figures_json(cards)}</script>
<script type="application/json" id="live-settings">{live_json}</script>
<script>{SCRIPT}</script></body></html>
"""
