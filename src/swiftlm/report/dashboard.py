"""The live dashboard: the report page of one run directory, served on 127.0.0.1 while the run
trains (`swiftlm sft --dashboard`, or `swiftlm report RUN_DIR --serve`).

A stdlib `ThreadingHTTPServer` in a daemon thread (no web framework: it must cost the training
process nothing and add no dependency) answers two routes:
- `GET /`: the report page, with live settings, so it polls the next route;
- `GET /data?since=VERSION`: `{"version"}` alone while nothing changed, else the page's cards
  and figures rebuilt from the run directory, which the page applies in place.
The version is the size and mtime of every file the report reads, so the reply is a stat()
call per file until a step is logged; the cards are then rebuilt once per change and cached.
"""

import errno
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from swiftlm.errors import ConfigError, SwiftLMError
from swiftlm.report.cards import build_cards
from swiftlm.report.page import render_page
from swiftlm.report.run_data import check_run_dir, load_run, thin, version

POLL_MS = 1000  # a logged step shows within about a second (the promise is 5 s)
LIVE_ROWS = 2000  # points per curve on the live page


class RunView:
    """The run directory's cards, rebuilt when `version` changes (one lock: the server's threads
    may ask together). The dashboard lives in the training process, so a rebuild is bounded:
    curves are thinned to LIVE_ROWS points, and rebuilds are spaced by at least twice the last
    one's duration, so drawing never takes more than a third of one core from training."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.lock = threading.Lock()
        self.version = ""
        self.update: dict = {}
        self.next_build = 0.0

    def current(self) -> dict:
        with self.lock:
            now = version(self.run_dir)
            if now != self.version and time.monotonic() >= self.next_build:
                started = time.monotonic()
                self.update = self.build(now)
                self.version = now
                elapsed = time.monotonic() - started
                self.next_build = time.monotonic() + 2 * elapsed
            return self.update

    def build(self, now: str) -> dict:
        run = load_run(self.run_dir, require_metrics=False)
        run.train = thin(run.train, LIVE_ROWS)
        cards = build_cards([run])
        return {
            "version": now,
            "latest_step": run.latest_step(),
            "names": [run.name],
            "cards": [card.payload() for card in cards],
            "figures": {c.name: c.figure for c in cards if c.figure is not None},
            "_cards": cards,
        }


class Handler(BaseHTTPRequestHandler):
    """`/` and `/data`; the view is set on the server."""

    server: "DashboardServer"

    def do_GET(self):  # noqa: N802 (the stdlib's name)
        url = urlparse(self.path)
        try:
            if url.path in ("/", "/index.html", "/report.html"):
                self.page()
            elif url.path == "/data":
                since = parse_qs(url.query).get("since", [""])[0]
                self.data(since)
            else:
                self.reply(404, "text/plain", b"not found: the dashboard serves / and /data")
        except SwiftLMError as exc:  # a damaged metrics line: say so on the page's poll
            self.reply(500, "text/plain", str(exc).encode())

    def page(self):
        update = self.server.view.current()
        live = {"version": update["version"], "interval_ms": POLL_MS}
        text = render_page(update["_cards"], update["names"], update["latest_step"], live)
        self.reply(200, "text/html; charset=utf-8", text.encode())

    def data(self, since: str):
        from plotly.utils import PlotlyJSONEncoder

        update = self.server.view.current()
        if since == update["version"]:
            body = {"version": update["version"]}
        else:
            body = {k: v for k, v in update.items() if not k.startswith("_")}
        self.reply(200, "application/json", json.dumps(body, cls=PlotlyJSONEncoder).encode())

    def reply(self, code: int, content_type: str, body: bytes):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002
        pass  # the training log is for training; requests are not news


class DashboardServer(ThreadingHTTPServer):
    daemon_threads = True  # a browser tab left open must not keep the process alive

    def __init__(self, address, view: RunView):
        self.view = view
        super().__init__(address, Handler)


class Dashboard:
    """The live page of `run_dir` on http://host:port (port 0: a free one); `start()` returns
    the URL, `stop()` shuts the server down. `flag` names the option that chose the port, for
    the error when it is taken (`--dashboard_port` in training, `--port` for `swiftlm report`)."""

    def __init__(
        self, run_dir: Path, port: int = 0, host: str = "127.0.0.1", flag: str = "--dashboard_port"
    ):
        self.run_dir = Path(run_dir)
        self.port, self.host, self.flag = port, host, flag
        self.server: DashboardServer | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> str:
        check_run_dir(self.run_dir, require_metrics=False)
        try:
            self.server = DashboardServer((self.host, self.port), RunView(self.run_dir))
        except OSError as exc:
            raise ConfigError(self._bind_error(exc)) from None
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="swiftlm-dashboard", daemon=True
        )
        self.thread.start()
        return self.url

    def _bind_error(self, exc: OSError) -> str:
        where = f"{self.host}:{self.port}"
        if exc.errno == errno.EADDRINUSE:
            return (
                f"dashboard: port {self.port} on {self.host} is already in use; choose another "
                f"with {self.flag} N, or {self.flag} 0 for a free one"
            )
        return (
            f"dashboard: cannot listen on {where} ({exc.strerror}); check the host and {self.flag}"
        )

    @property
    def url(self) -> str:
        if self.server is None:
            raise RuntimeError("Dashboard.url before start()")
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/"

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        if self.thread is not None:
            self.thread.join(timeout=5)
            self.thread = None

    def __enter__(self) -> "Dashboard":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
