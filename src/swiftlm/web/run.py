"""`swiftlm web`: serve the browser UI on --host:--port until Ctrl-C.

The UI only starts, stops and reads ordinary swiftlm processes and run directories, so
stopping it stops no run: the next `swiftlm web` on the same --runs_dir reattaches to them.
"""

import socket
from pathlib import Path

from swiftlm.config import WebConfig
from swiftlm.errors import ConfigError
from swiftlm.serve.run import require_serve_extra

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything is printed (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"--host {host} --port {port}: cannot listen there ({exc.strerror}); pick another "
            "--port (0: a free one), or stop what uses it"
        ) from None
    sock.listen(128)
    return sock


def run(cfg: WebConfig) -> None:
    require_serve_extra("web", ("fastapi", "uvicorn"))  # before importing them
    import uvicorn

    from swiftlm.web.app import create_app

    args = cfg.web
    runs_dir = Path(args.runs_dir).expanduser()
    runs_dir.mkdir(parents=True, exist_ok=True)
    sock = bind(args.host, args.port)
    app = create_app(runs_dir, args.api_key)
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"swiftlm web: http://{host}:{port}/  (runs in {runs_dir.resolve()})", flush=True)
    if args.api_key is None and args.host not in LOCAL_HOSTS:
        print("Warning: no --api_key and not bound to localhost: anyone can start runs", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])
    print("swiftlm web: stopped (runs go on; `swiftlm web` again reattaches)", flush=True)
