"""`swiftlm report RUN_DIR [RUN_DIR ...]`: a run, or several overlaid, as one offline HTML page.

`write_report` reads each run directory (`run_data.py`), turns it into cards of plots and
tables (`cards.py`) and writes one self-contained page (`page.py`): plotly.js
is inlined, so the file opens anywhere without a network. `--serve` then keeps the page live
with the `Dashboard` of the first run directory until Ctrl-C.
"""

import os
import tempfile
import time
from pathlib import Path

from swiftlm.errors import ConfigError
from swiftlm.report.cards import build_cards
from swiftlm.report.page import render_page
from swiftlm.report.run_data import RunData, load_run, unique_names

REPORT_NAME = "report.html"


def page_for(runs: list[RunData], live: dict | None = None) -> str:
    """The page of already-loaded runs (the dashboard builds it again on each change)."""
    steps = [s for s in (run.latest_step() for run in runs) if s is not None]
    latest = max(steps) if steps else None
    return render_page(build_cards(runs), [run.name for run in runs], latest, live)


def default_output(run_dirs: list[Path]) -> Path:
    """One run: next to its metrics; several: the current folder (no run owns the overlay)."""
    return run_dirs[0] / REPORT_NAME if len(run_dirs) == 1 else Path.cwd() / REPORT_NAME


def write_atomic(path: Path, text: str) -> None:
    """Write beside the target, then rename, so a browser reloading never sees half a page."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".html", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the page from other users
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the report to {path}: {exc.strerror}; choose a writable --output"
        ) from None


def write_report(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Write report.html for one run directory, or several overlaid; return its path."""
    if not run_dirs:
        raise ConfigError("swiftlm report: give at least one run directory (RUN_DIR ...)")
    run_dirs = [Path(p) for p in run_dirs]
    runs = [load_run(path) for path in run_dirs]
    unique_names(runs)
    out = Path(out) if out is not None else default_output(run_dirs)
    if out.is_dir():
        out = out / REPORT_NAME
    write_atomic(out, page_for(runs))
    return out


def serve_until_interrupted(run_dir: Path, port: int, host: str) -> None:
    """The live dashboard of `run_dir` in the foreground, until Ctrl-C."""
    from swiftlm.report.dashboard import Dashboard

    dashboard = Dashboard(run_dir, port=port, host=host, flag="--port")
    url = dashboard.start()
    print(f"Serving the live report of {run_dir} on {url} (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        dashboard.stop()


def run(cfg) -> None:
    """The `swiftlm report` command (`ReportConfig`)."""
    args = cfg.report
    run_dirs = [Path(p) for p in args.run_dirs]
    path = write_report(run_dirs, Path(args.output) if args.output else None)
    print(f"Report written to {path}", flush=True)
    if args.serve:
        if len(run_dirs) > 1:
            print(f"--serve shows one run live: {run_dirs[0]}", flush=True)
        serve_until_interrupted(run_dirs[0], args.port, args.host)
