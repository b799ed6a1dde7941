"""Helpers of the serving tests: uvicorn in a thread, an app's routes, and a deliberately slow
engine."""

import os
import socket
import subprocess
import tempfile
import threading
import time
from collections import deque

from swiftlm.engine.protocol import EngineStats, SampleDelta


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server_process(command: list[str], env: dict, url: str, what: str, timeout=300):
    """Start a server command (`swiftlm deploy`, `swiftlm rollout` ...) and wait until its
    /health answers 200. Its output goes to a file (a pipe nobody reads would fill and stop
    the server): `server_output(process)` reads it."""
    import httpx

    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives as long as the server)
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env}
    )
    process.log = log
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, server_output(process)
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{what} did not start: {server_output(process)}"
        time.sleep(0.5)


def server_output(process) -> str:
    process.log.seek(0)
    return process.log.read()


def app_routes(app) -> list[tuple[str, str]]:
    """(path, method) of every route `app` serves, the routes of its routers included: FastAPI
    0.137+ keeps an included router as one node of `app.routes`, which iter_route_contexts
    (0.137.2+) opens; before, `app.routes` held the routes themselves."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:
        routes = app.routes
    else:
        routes = iter_route_contexts(app.routes)
    return [(r.path, sorted(r.methods)[0]) for r in routes if getattr(r, "methods", None)]


class ServerThread:
    """`with ServerThread(app) as url:` serves `app` with uvicorn on a free port."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=20)


class SlowEngine:
    """An `Engine` that emits one token (`token_id`, text "a") per sample every `delay` s, with
    `max_num_seqs` slots and a waiting queue: slow and predictable, so that tests can see a
    full queue, a freed slot or a timeout happen."""

    def __init__(self, token_id: int, max_num_seqs: int = 1, max_model_len: int = 256, delay=0.05):
        self.token_id = token_id
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.delay = delay
        self.aborted_ids: list[str] = []
        self._lock = threading.Lock()
        self._waiting: deque = deque()
        # request id -> [request, on_delta, tokens generated so far (None while it waits)]
        self._running: dict[str, list] = {}
        self._abort: set[str] = set()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def submit(self, request, on_delta) -> None:
        problem = request.params.check()
        if problem:
            raise ValueError(problem)
        with self._lock:
            self._waiting.append(request.request_id)
            self._running[request.request_id] = [request, on_delta, None]

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._abort.add(request_id)

    def stats(self) -> EngineStats:
        with self._lock:
            running = sum(e[0].params.n for e in self._running.values() if e[2] is not None)
            return EngineStats(running, len(self._waiting), self.max_num_seqs, self.max_model_len)

    def generate(self, requests):
        raise NotImplementedError

    def shutdown(self) -> None:
        self._stop = True
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop:
            time.sleep(self.delay)
            with self._lock:
                events = self._step()
            for on_delta, delta in events:
                on_delta(delta)

    def _step(self) -> list:
        events = []
        for request_id in list(self._abort):
            entry = self._running.pop(request_id, None)
            if entry is not None:
                self.aborted_ids.append(request_id)
                if request_id in self._waiting:
                    self._waiting.remove(request_id)
                for i in range(entry[0].params.n):
                    events.append((entry[1], SampleDelta(request_id, i, (), "", (), "abort")))
        self._abort.clear()
        busy = sum(1 for e in self._running.values() if e[2] is not None)
        while self._waiting and busy < self.max_num_seqs:
            self._running[self._waiting.popleft()][2] = 0
            busy += 1
        for request_id, entry in list(self._running.items()):
            if entry[2] is None:
                continue
            request, on_delta, _ = entry
            entry[2] = entry[2] + 1
            done = entry[2] >= request.params.max_tokens
            for i in range(request.params.n):
                delta = SampleDelta(
                    request_id, i, (self.token_id,), "a", (), "length" if done else None
                )
                events.append((on_delta, delta))
            if done:
                del self._running[request_id]
        return events
