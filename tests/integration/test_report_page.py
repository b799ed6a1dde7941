"""report.html and the live dashboard in headless Chromium: the page opens from disk with no
console error and no network request, draws every plot, and the live page shows a newly logged
step within 5 s. A screenshot of the whole report is kept in the test's tmp dir."""

import shutil
import time

import pytest
from cdp_helpers import Browser, chromium_path

from report_runs import STEPS, train_row, write_jsonl, write_run
from swiftlm.report.cards import PLOTS
from swiftlm.report.dashboard import Dashboard
from swiftlm.report.run import write_report

# Any host name that reaches the resolver fails: a page that tried the network would error.
OFFLINE = ("--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",)
DOMAINS = ("Runtime.enable", "Log.enable", "Network.enable", "Page.enable")
RENDERED = "document.body && document.body.dataset.rendered === 'true'"


@pytest.fixture(autouse=True)
def needs_chromium():
    if chromium_path() is None:
        pytest.skip("chromium is not installed (.ci/run installs it with apt-get as root)")


def open_page(page: Browser, url: str) -> None:
    """Navigate after enabling the domains, so that every event of the load is seen."""
    for domain in DOMAINS:
        page.call(domain)
    page.call("Page.navigate", url=url)
    page.wait_for(RENDERED, timeout=30)


def errors(page: Browser) -> list:
    console = [e for e in page.events_of("Runtime.consoleAPICalled") if e["type"] == "error"]
    logged = [e for e in page.events_of("Log.entryAdded") if e["entry"]["level"] == "error"]
    return console + logged + page.events_of("Runtime.exceptionThrown")


def requested(page: Browser) -> list[str]:
    return [e["request"]["url"] for e in page.events_of("Network.requestWillBeSent")]


def drawn_plots(page: Browser) -> dict:
    """{data-plot marker: number of plotly SVG roots inside it}."""
    return page.eval(
        "Object.fromEntries([...document.querySelectorAll('div.plot[data-plot]')]"
        ".map(d => [d.dataset.plot, d.querySelectorAll('.main-svg').length]))"
    )


def full_page_screenshot(page: Browser, path, width: int) -> None:
    height = page.eval("document.documentElement.scrollHeight")
    page.call(
        "Emulation.setDeviceMetricsOverride",
        width=width,
        height=height,
        deviceScaleFactor=1,
        mobile=False,
    )
    page.eval("new Promise(r => requestAnimationFrame(() => setTimeout(r, 300)))")
    page.screenshot(path)


def test_the_report_opens_offline_and_draws_every_plot(tmp_path):
    run = write_run(tmp_path / "run-a")
    report = write_report([run])
    with Browser("about:blank", tmp_path / "profile", 1400, 900, OFFLINE) as page:
        open_page(page, report.as_uri())
        plots = drawn_plots(page)
        assert len(plots) == len(PLOTS) + 5, plots  # + a data-health histogram, 4 method metrics
        assert all(count >= 1 for count in plots.values()), plots
        assert page.eval("document.querySelectorAll('[data-missing]').length") == 0
        assert errors(page) == []
        urls = requested(page)
        assert urls[0] == report.as_uri()
        assert all(url.startswith(("file://", "data:")) for url in urls), urls
        assert page.eval("document.getElementById('latest-step').dataset.step") == str(STEPS)
        full_page_screenshot(page, tmp_path / "report.png", 1400)
    assert (tmp_path / "report.png").stat().st_size > 50_000
    shutil.copy(tmp_path / "report.png", "/tmp/report_page.png")


def test_the_live_page_shows_a_new_step_within_5_seconds(tmp_path):
    run = write_run(tmp_path / "run-live", ranks=2)
    with (
        Dashboard(run) as dashboard,
        Browser("about:blank", tmp_path / "profile", 1200, 800, OFFLINE) as page,
    ):
        open_page(page, dashboard.url)
        page.wait_for("document.getElementById('live-status').className === 'live'", 10)
        step = STEPS + 1
        logged = time.monotonic()
        write_jsonl(run / "metrics.jsonl", [{**train_row(step, ranks=2), "kl": 9.0}])
        page.wait_for(
            f"document.getElementById('latest-step').dataset.step === '{step}'", timeout=5
        )
        loss_x = "document.querySelector('div.plot[data-plot=loss]').data[0].x"
        page.wait_for(f"{loss_x}.includes({step})", timeout=5 - (time.monotonic() - logged))
        assert time.monotonic() - logged < 5
        kl_y = "document.querySelector('div.plot[data-plot=\"method:kl\"]').data[0].y"
        assert page.eval(f"{kl_y}.at(-1)") == 9.0
        assert all(count >= 1 for count in drawn_plots(page).values())
        assert errors(page) == []
        urls = requested(page)
        assert all(url.startswith((dashboard.url, "data:")) for url in urls), urls


def check_real_report(run_dir, tmp_path, recorded: set[str]) -> dict:
    """Open the report a training run wrote itself: no console error, no network, the plots
    of what a one-process run records all drawn; returns {plot: SVG roots}."""
    report = run_dir / "report.html"
    with Browser("about:blank", tmp_path / "profile", 1400, 900, OFFLINE) as page:
        open_page(page, report.as_uri())
        plots = drawn_plots(page)
        assert errors(page) == []
        assert all(url.startswith(("file://", "data:")) for url in requested(page))
        full_page_screenshot(page, tmp_path / "report.png", 1400)
    assert recorded <= {name for name, count in plots.items() if count >= 1}, plots
    return plots


ONE_PROCESS_PLOTS = {
    "loss", "learning_rate", "grad_norm", "tokens_per_second", "mfu", "memory", "step_time",
    "goodput", "grad_norm_layers", "grad_histograms",
}  # fmt: skip


def test_a_training_run_writes_a_report_that_opens_and_draws(tiny_model_dir, chat_jsonl, tmp_path):
    from conftest import tiny_sft
    from swiftlm.cli.main import main

    out = tmp_path / "run"
    flags = dict(max_steps=6, logging_steps=2, histogram_steps=3, split_dataset_ratio=0.2)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, out, eval_steps=3, **flags)) == 0
    plots = check_real_report(out, tmp_path, ONE_PROCESS_PLOTS)
    assert any(name.startswith("data_health:") for name in plots)  # the length histogram


@pytest.mark.slow
def test_the_default_job_report_opens_and_draws(tmp_path):
    """The default model and data (first 16 steps of the default job)."""
    from swiftlm.cli.main import main

    out = tmp_path / "default"
    argv = ["sft", "--output_dir", str(out), "--max_steps", "16", "--histogram_steps", "8"]
    assert main(argv) == 0
    check_real_report(out, tmp_path, ONE_PROCESS_PLOTS)
    shutil.copy(tmp_path / "report.png", "/tmp/default_job_report.png")
