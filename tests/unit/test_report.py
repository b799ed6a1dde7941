"""`swiftlm report` and the live dashboard on synthetic run directories: every plot marker, the
anomalies listed and marked, eval overlaid on train, a resumed step kept once, several runs
overlaid with a config diff of only the differing keys, the stacked step-time breakdown made of
exactly the phases, missing files said so, and clear errors for a bad run directory or port."""

import json
import re
import socket
import time
import urllib.request

import pytest

from report_runs import PHASES, SPIKE_STEP, STEPS, eval_row, train_row, write_jsonl, write_run
from swiftlm.cli.main import main
from swiftlm.errors import ConfigError
from swiftlm.report.cards import PLOTS, build_cards
from swiftlm.report.dashboard import Dashboard
from swiftlm.report.run import write_report
from swiftlm.report.run_data import load_run

FULL_MARKERS = {
    *PLOTS,
    "data_health:lengths",
    "method:reward",
    "method:rewards/accuracy",
    "method:kl",
    "method:eval_accuracy",
}


def markers(page: str, attribute: str = "data-plot") -> list[str]:
    return re.findall(rf'<div class="plot" {attribute}="([^"]+)"', page)


def page_figures(page: str) -> dict:
    text = page.split('<script type="application/json" id="figures">', 1)[1].split("</script>")[0]
    return json.loads(text)


def traces(figure: dict, name_part: str = "") -> list[dict]:
    return [t for t in figure["data"] if name_part in t.get("name", "")]


@pytest.fixture
def run(tmp_path):
    return write_run(tmp_path / "run-a")


def test_the_report_has_every_plot_and_needs_no_network(run):
    path = write_report([run])
    assert path == run / "report.html"
    page = path.read_text(encoding="utf-8")
    assert set(markers(page)) == FULL_MARKERS
    assert 'data-missing="' not in page
    assert set(page_figures(page)) == FULL_MARKERS
    # plotly.js is inlined once; nothing is loaded from anywhere.
    assert page.count("<script") == 4  # plotly.js, figures, live settings, the page's script
    ours = page.split("</style>", 1)[0] + page.split("</script></head>", 1)[1]
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", ours)
    assert "static report" in page and 'id="latest-step" data-step="40"' in page
    for text in ("aten::mm", "padding_efficiency", "tokens", "learning_rate: 0.0001", "finished"):
        assert text in page, text


def test_anomalies_are_listed_and_marked_on_their_curves(run):
    page = write_report([run]).read_text(encoding="utf-8")
    assert f"loss 6.0 at step {SPIKE_STEP} is 4.0x its median" in page
    assert "grad norm 10.0 at step 25 is 10x its median" in page
    figures = page_figures(page)
    (loss_marks,) = traces(figures["loss"], "anomalies")
    assert loss_marks["x"] == [SPIKE_STEP] and loss_marks["y"] == [6.0]
    (grad_marks,) = traces(figures["grad_norm"], "anomalies")
    assert grad_marks["x"] == [25]


def test_eval_loss_is_overlaid_and_a_resumed_step_is_kept_once(run):
    figures = page_figures(write_report([run]).read_text(encoding="utf-8"))
    (train,) = traces(figures["loss"], "train")
    (evals,) = traces(figures["loss"], "eval")
    assert evals["x"] == [10, 20, 30, 40]
    assert train["x"] == list(range(1, STEPS + 1))  # 19 and 20 were logged twice
    assert train["y"][19] == 0.25  # the later row of step 20 wins


def test_the_stacked_breakdown_is_the_phases_and_adds_up_to_the_step(run):
    figure = page_figures(write_report([run]).read_text(encoding="utf-8"))["step_time"]
    stacked = [t for t in figure["data"] if t.get("stackgroup")]
    assert [t["name"] for t in stacked] == list(PHASES)
    (measured,) = traces(figure, "step (measured)")
    for i in range(STEPS):
        assert sum(t["y"][i] for t in stacked) == pytest.approx(measured["y"][i])
    assert stacked[0]["customdata"][0] == pytest.approx(train_row(1)["share/data"])


def test_several_runs_overlay_their_curves_and_diff_only_differing_keys(tmp_path, monkeypatch):
    first = write_run(tmp_path / "run-a", learning_rate=1e-4)
    second = write_run(tmp_path / "run-b", learning_rate=3e-4, ranks=1)
    monkeypatch.chdir(tmp_path)
    path = write_report([first, second])
    assert path == tmp_path / "report.html"
    page = path.read_text(encoding="utf-8")
    figures = page_figures(page)
    names = [t["name"] for t in figures["loss"]["data"]]
    assert {"run-a: train", "run-a: eval", "run-b: train", "run-b: eval"} <= set(names)
    assert [t["name"] for t in figures["learning_rate"]["data"]] == ["run-a", "run-b"]
    # Heatmaps stack one row per run that has the data: run-b ran on one rank.
    assert len(figures["rank_step_time"]["data"]) == 1
    assert len(figures["grad_norm_layers"]["data"]) == 2
    diff = page.split('<table class="config-diff">', 1)[1].split("</table>")[0]
    assert re.findall(r"<tr><td>([^<]+)</td>", diff) == ["train.learning_rate"]
    assert "0.0003" in diff and "max_steps" not in diff


def test_runs_with_the_same_folder_name_get_distinct_trace_names(tmp_path):
    a = write_run(tmp_path / "a" / "run", full=False)
    b = write_run(tmp_path / "b" / "run", full=False)
    figures = page_figures(write_report([a, b], tmp_path / "out").read_text(encoding="utf-8"))
    assert [t["name"] for t in figures["learning_rate"]["data"]] == ["a/run", "b/run"]


def test_a_plain_run_says_which_sections_were_not_recorded(tmp_path):
    run = write_run(tmp_path / "old-run", full=False)
    page = write_report([run], tmp_path / "r.html").read_text(encoding="utf-8")
    assert set(markers(page)) == {"loss", "learning_rate", "grad_norm"}
    missing = set(re.findall(r'data-missing="([^"]+)"', page))
    assert {"step_time", "goodput", "rank_step_time", "grad_norm_layers", "data_health"} <= missing
    assert {"method", "profile", "mfu"} <= missing
    assert page.count("not recorded in this run") == len(missing)
    assert "No anomaly was flagged." in page
    assert "running or stopped" in page  # no summary.json: read off the metrics


@pytest.mark.bad_input(
    input="`swiftlm report` on a metrics.jsonl with a damaged line (or a half-written last "
    "line of a run still training)",
    outcome="Error naming metrics.jsonl:LINE; a half-written last line is left out (the "
    "writer is mid-line), never an error",
)
def test_a_half_written_last_line_is_skipped_and_a_damaged_one_named(tmp_path):
    run = write_run(tmp_path / "run", full=False)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 41, "lo')
    assert load_run(run).latest_step() == STEPS
    with (run / "metrics.jsonl").open("a") as f:
        f.write('\n{"step": 42, "loss": 1.0}\n')
    with pytest.raises(ConfigError, match=r"metrics.jsonl:41: not a JSON object"):
        write_report([run])


@pytest.mark.bad_input(
    input="`swiftlm report PATH` where PATH is missing, a file, or a folder without "
    "metrics.jsonl; or no run directory at all",
    outcome="Error (exit 2) naming the path and what it is, and that a run directory is "
    "the --output_dir of a training run",
)
def test_a_bad_run_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist; give the --output_dir"):
        write_report([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no metrics.jsonl"):
        write_report([tmp_path / "empty"])
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a run directory"):
        write_report([tmp_path / "file.txt"])
    with pytest.raises(ConfigError, match="at least one run directory"):
        write_report([])


def test_the_cli_writes_the_report_and_prints_its_path(run, tmp_path, capsys):
    out = tmp_path / "elsewhere" / "page.html"
    assert main(["report", str(run), "--output", str(out)]) == 0
    assert f"Report written to {out}" in capsys.readouterr().out
    assert out.is_file()
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["report"]) == 2
    assert "give at least one run directory" in capsys.readouterr().err


def get(url: str):
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.headers.get("Content-Type"), reply.read().decode()


def poll_for_change(url: str, version: str, timeout: float = 5.0) -> dict:
    """Poll /data as the page does: a rebuild may be held back (rebuilds are spaced by twice
    their duration, which a loaded machine stretches)."""
    deadline = time.monotonic() + timeout
    while True:
        reply = json.loads(get(f"{url}data?since={version}")[1])
        if reply["version"] != version or time.monotonic() > deadline:
            return reply
        time.sleep(0.1)


def test_the_dashboard_serves_the_page_and_sends_changes_only(tmp_path):
    run = tmp_path / "live"
    run.mkdir()  # started before the first logged step
    with Dashboard(run) as dashboard:
        assert dashboard.url.startswith("http://127.0.0.1:")
        kind, page = get(dashboard.url)
        assert kind.startswith("text/html") and '"interval_ms"' in page
        assert 'data-missing="loss"' in page
        first = json.loads(get(dashboard.url + "data?since=")[1])
        assert first["latest_step"] is None and first["cards"]
        same = json.loads(get(f"{dashboard.url}data?since={first['version']}")[1])
        assert same == {"version": first["version"]}
        write_jsonl(run / "metrics.jsonl", [train_row(1), eval_row(1)])
        update = poll_for_change(dashboard.url, first["version"])
        assert update["latest_step"] == 1 and update["version"] != first["version"]
        assert update["figures"]["loss"]["data"][0]["x"] == [1]
        names = {card["name"] for card in update["cards"]}
        assert names >= {"loss", "rank_step_time", "method:reward"} and "method" not in names
    assert dashboard.server is None


@pytest.mark.bad_input(
    input="`--dashboard_port N` (or `swiftlm report --serve --port N`) on a port already in use",
    outcome="Error naming the port, the flag to change and `0` for a free port",
)
def test_a_busy_port_names_the_flag_that_chose_it(tmp_path):
    run = write_run(tmp_path / "run", full=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} .* in use.*--dashboard_port"):
            Dashboard(run, port=port).start()
        with pytest.raises(ConfigError, match="--port N"):
            Dashboard(run, port=port, flag="--port").start()
    with pytest.raises(ConfigError, match="does not exist"):
        Dashboard(tmp_path / "nope").start()


def test_cards_are_stable_between_builds(run):
    """The live page replaces a card only when its markup changes: same data, same hash."""
    first = [c.payload()["hash"] for c in build_cards([load_run(run)])]
    assert first == [c.payload()["hash"] for c in build_cards([load_run(run)])]


def test_the_live_view_thins_long_curves_and_keeps_the_last_step():
    from swiftlm.report.run_data import thin

    rows = [{"step": s} for s in range(1, 5002)]
    kept = thin(rows, 2000)
    assert len(kept) <= 2001 and kept[0]["step"] == 1 and kept[-1]["step"] == 5001
    assert thin(rows[:10], 2000) == rows[:10]


def test_a_nonfinite_loss_is_marked_at_its_running_median(tmp_path):
    run = write_run(tmp_path / "run", full=False)
    nan = {"step": 7, "kind": "nonfinite", "value": float("nan"), "median": 2.5, "message": "nan"}
    write_jsonl(run / "anomalies.jsonl", [nan])
    figures = page_figures(write_report([run]).read_text(encoding="utf-8"))
    (marks,) = traces(figures["loss"], "anomalies")
    assert marks["x"] == [7] and marks["y"] == [2.5]
    (grad_marks,) = traces(figures["grad_norm"], "anomalies")  # a NaN gradient shows there too
    assert grad_marks["x"] == [7]
