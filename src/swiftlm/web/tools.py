"""The chat, export and evaluation tabs: `swiftlm deploy`, `swiftlm export` and `swiftlm eval`
run as ordinary processes, like the runs (`runs.Registry`), each in a job folder with its log.

Chat: one `swiftlm deploy --ckpt_dir <run or checkpoint>` at a time on a free local port; the
UI forwards the page's OpenAI chat requests to it, streaming, so the page needs no second
origin and the key of the UI is the only key.
"""

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from swiftlm.errors import ConfigError
from swiftlm.web.forms import build_argv, parse_checked
from swiftlm.web.runs import Registry, read_json, tail_lines

SERVED_NAME = "swiftlm-web"
STOP_WAIT_S = 40.0  # deploy drains running requests (its --shutdown_timeout, 30 s) on SIGTERM
RESULT_FILES = ("summary.json",)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def check_model_path(path: str) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"model {path}: no such folder; choose a run, its final/ or a checkpoint")
    return folder


class ChatServer:
    """The deploy process of the chat tab (job folder RUNS_DIR/.web/chat)."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self.folder = registry.runs_dir / ".web" / "chat"

    def status(self) -> dict:
        if not (self.folder / "web_run.json").is_file():
            return {"state": "none", "ready": False}
        info = self.registry.state(self.folder)
        extra = info.get("extra", {})
        info.update(model=extra.get("model"), port=extra.get("port"))
        info["ready"] = info["state"] == "running" and self._healthy(extra.get("port"))
        info["log"] = "\n".join(tail_lines(self.folder / "web.log", 30))
        return info

    def _healthy(self, port: int | None) -> bool:
        if not port:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                return reply.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def load(self, path: str) -> dict:
        """Serve `path` (a run directory, its final/ or a checkpoint); the one served before
        is stopped first. Returns at once: the page polls `status` until `ready`."""
        folder = check_model_path(path)
        current = self.status()
        if current["state"] == "running":
            if current.get("model") == str(folder):
                return current
            self.registry.stop(self.folder)
            self._wait_stopped()
        port = free_port()
        argv = ["deploy", "--ckpt_dir", str(folder), "--port", str(port)]
        argv += ["--served_model_name", SERVED_NAME]
        parse_checked_deploy(argv)
        self.registry.start(self.folder, argv, {"model": str(folder), "port": port})
        return self.status()

    def unload(self) -> dict:
        """Stop the chat server (its memory back); the next Load starts one again."""
        if self.status()["state"] == "running":
            self.registry.stop(self.folder)
        return self.status()

    def _wait_stopped(self) -> None:
        deadline = time.monotonic() + STOP_WAIT_S
        while self.registry.state(self.folder)["state"] == "running":
            if time.monotonic() > deadline:
                raise ConfigError("the chat server did not stop; try again in a moment")
            time.sleep(0.2)

    def stream(self, request: dict) -> Iterator[bytes]:
        """The deploy server's answer to an OpenAI chat request, as it arrives."""
        status = self.status()
        if not status["ready"]:
            raise ConfigError("no model is loaded for chat yet: choose one and press Load")
        body = json.dumps({**request, "model": SERVED_NAME}).encode()
        url = f"http://127.0.0.1:{status['port']}/v1/chat/completions"
        upstream = urllib.request.Request(
            url, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            reply = urllib.request.urlopen(upstream, timeout=600)
        except urllib.error.HTTPError as exc:  # the server's own error (bad request ...)
            raise ConfigError(exc.read().decode("utf-8", errors="replace")) from None
        return _chunks(reply)


def _chunks(reply) -> Iterator[bytes]:
    with reply:
        while True:
            line = reply.readline()
            if not line:
                return
            yield line


def parse_checked_deploy(argv: list[str]) -> None:
    """`swiftlm deploy`'s own flag checks, before the process starts."""
    import swiftlm.config as config_module
    from swiftlm.config.parse import parse_config

    parse_config(config_module.DeployConfig, argv[1:], "swiftlm deploy", "", frozenset())


def start_tool(registry: Registry, kind: str, model: str, values: dict[str, str]) -> dict:
    """Run `swiftlm export` or `swiftlm eval` on a run or checkpoint in a new job folder;
    where it writes is chosen by the UI (the job folder), so the tab can show the results."""
    if kind not in ("export", "eval"):
        raise ConfigError(f"the tools are export and eval, not '{kind}'")
    folder = registry.job_folder(kind)
    target = str(check_model_path(model))
    output = ["--output_dir", str(folder / "model")] if kind == "export" else []
    output = output or ["--eval_output_dir", str(folder / "results")]
    argv = ["--ckpt_dir", target, *build_argv(kind, values), *output]
    parse_checked(kind, argv)
    return registry.start(folder, [kind, *argv], {"model": target})


def tool_result(folder: Path) -> dict:
    """The results a finished export or evaluation left: eval's summary, export's files."""
    results = {}
    for name in RESULT_FILES:
        found = read_json(folder / "results" / name)
        if found is not None:
            results[name] = found
    model = folder / "model"
    if model.is_dir():
        results["files"] = sorted(
            f"{p.relative_to(model)} ({p.stat().st_size:,} bytes)"
            for p in model.rglob("*")
            if p.is_file()
        )
    return results
