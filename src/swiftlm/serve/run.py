"""`swiftlm deploy`: load a model and its adapters, serve them over an OpenAI-compatible API.

SIGTERM drains: new requests get 503, running ones finish (up to --shutdown_timeout), the
process exits 0.
"""

import signal
import socket

from swiftlm.checkpoint.targets import check_weights_folders
from swiftlm.config import DeployConfig
from swiftlm.errors import ConfigError
from swiftlm.serve.models import DeployPlan, parse_adapters, plan_deployment

INSTALL_HINT = "pip install 'swiftlm[serve]'"


def require_serve_extra(
    command: str = "deploy", modules: tuple[str, ...] = ("fastapi", "uvicorn", "prometheus_client")
) -> None:
    """A clear error naming the serve extra when `swiftlm <command>` lacks its modules."""
    missing = []
    for name in modules:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ConfigError(
            f"swiftlm {command} needs {', '.join(missing)}, which could not be imported; "
            f"install the serve extra with `{INSTALL_HINT}`"
        )


def check_port_free(host: str, port: int) -> None:
    """Fail before the model loads when the address is taken (or not this machine's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                f"--host {host} --port {port}: cannot listen there ({exc.strerror}); pick "
                "another --port, or stop what uses it"
            ) from None


def check_tool_parser(name: str) -> None:
    """A --tool_call_parser that no one registered fails before the model loads."""
    from swiftlm.serve.tools import TOOL_PARSERS

    if name not in TOOL_PARSERS:
        raise ConfigError(
            f"--tool_call_parser {name}: no such parser; known: {', '.join(sorted(TOOL_PARSERS))} "
            "(a plugin given with --external_plugins or installed as a package can add one)"
        )


def run(cfg: DeployConfig) -> None:
    require_serve_extra()  # before minutes of model loading
    check_tool_parser(cfg.deploy.tool_call_parser)
    check_port_free(cfg.deploy.host, cfg.deploy.port)
    check_weights_folders(cfg.infer.ckpt_dir, list(parse_adapters(cfg.infer.adapters).values()))
    plan = plan_deployment(cfg)
    print(f"Loading {plan.spec.description}", flush=True)
    engine = start_engine(cfg, plan)
    try:
        serve(cfg, plan, engine)
    finally:
        engine.shutdown()
    print("swiftlm deploy: stopped", flush=True)


def start_engine(cfg: DeployConfig, plan: DeployPlan):
    """The generation engine, or for a reward model its scorer (no engine)."""
    if plan.reward_model:
        from swiftlm.engine.score import load_scorer

        return load_scorer(plan.spec, cfg.model)
    from swiftlm.engine.build import EngineOptions, engine_for_model

    d = cfg.deploy
    return engine_for_model(
        plan.spec,
        cfg.model,
        cfg.infer.seed,
        max_num_seqs=d.max_num_seqs,
        adapters=plan.named_adapters,
        max_model_len=d.max_model_len,
        max_pixels=plan.spec.max_pixels,
        options=EngineOptions.of(cfg.infer),
    )


def serve(cfg: DeployConfig, plan: DeployPlan, engine) -> None:

    from swiftlm.serve.app import ServerSettings, generation_app, scoring_app

    args = cfg.deploy
    settings = ServerSettings(
        api_keys=tuple(args.api_key),
        max_body_bytes=args.max_body_bytes,
        max_queued_requests=args.max_queued_requests,
        max_n=args.max_n,
        request_timeout=args.request_timeout,
        system=plan.spec.system,
        allow_local_images=args.allow_local_images,
        tool_call_parser=args.tool_call_parser,
    )
    if plan.reward_model:
        app = scoring_app(engine, plan.served, settings)
    else:
        app = generation_app(engine, engine.tokenizer, plan.served, settings)
    server = draining_server(app, args.host, args.port, args.shutdown_timeout)
    print(f"Serving {', '.join(plan.served.names())} at {url(args.host, args.port)}/v1", flush=True)
    if not args.api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        print("Warning: no --api_key and not bound to localhost: anyone can call it", flush=True)
    server.run()


def draining_server(app, host: str, port: int, shutdown_timeout: float):
    """uvicorn serving `app` (made by serve.app.create_app) at host:port, draining on SIGTERM
    for up to `shutdown_timeout` seconds."""
    import uvicorn

    config = uvicorn.Config(
        app, host=host, port=port, timeout_graceful_shutdown=shutdown_timeout, log_level="warning"
    )
    return draining_server_class()(config, app.state.server)


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def draining_server_class():
    """uvicorn's Server that, on SIGTERM or SIGINT, first turns new requests away (503)."""
    import uvicorn

    class Draining(uvicorn.Server):
        def __init__(self, config, state):
            super().__init__(config)
            self.state = state

        def handle_exit(self, sig, frame):
            self.state.draining = True
            super().handle_exit(sig, frame)
            # uvicorn raises a captured signal again once it has shut down, which would kill
            # the process by SIGTERM; a drained SIGTERM is a clean stop that exits 0.
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)

    return Draining
