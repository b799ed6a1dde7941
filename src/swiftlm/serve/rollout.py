"""`swiftlm rollout`: a vLLM engine served to GRPO/GKD trainers (`--vllm_mode server`), as
`trl vllm-serve` and ms-swift's `swift rollout` do.

The trainer pushes its weights before every generation over a process group of its own with
the vLLM workers (`engine.vllm_weight_sync`): `POST /weights/init/` and `/weights/update/`
start the workers' side of a collective and answer at once, the trainer then runs its side,
and `POST /weights/wait/` answers when the workers are done (with their error, if any).
`POST /generate/` samples token-id prompts with swiftlm's `SamplingParams`, one list of
samples per request. While a weight call is pending, generation is refused (409): it would
sample from half-loaded weights.

The app is `swiftlm deploy`'s (serve.app.create_app): body limit, drain on SIGTERM, /health,
/metrics, JSON errors that name the field. It has no API keys (as `trl vllm-serve`): whoever
reaches it can push weights, so it answers only this machine unless --host says otherwise.
"""

from swiftlm.config import RolloutConfig
from swiftlm.engine.vllm_backend import import_vllm
from swiftlm.models.loader import ResolvedModel, resolve_model
from swiftlm.serve.run import check_port_free, draining_server, require_serve_extra, url

MAX_BODY_BYTES = 256 * 1024 * 1024  # a generation call carries every prompt of a step


def run(cfg: RolloutConfig) -> None:
    require_serve_extra("rollout")
    d = cfg.deploy
    check_port_free(d.host, d.port)
    import_vllm(flag=None)  # before a GGUF is converted for it
    model = resolve_model(cfg.model.model)
    engine = start_engine(cfg, model)
    try:
        serve(cfg, engine, model.name)
    finally:
        engine.shutdown()
    print("swiftlm rollout: stopped", flush=True)


def start_engine(cfg: RolloutConfig, model: ResolvedModel):
    from swiftlm.engine.vllm_backend import VllmOptions, build_vllm_engine
    from swiftlm.engine.vllm_weight_sync import WORKER_EXTENSION

    i = cfg.infer
    options = VllmOptions(
        gpu_memory_utilization=i.vllm_gpu_memory_utilization,
        tensor_parallel_size=i.vllm_tensor_parallel_size,
        enforce_eager=i.vllm_enforce_eager,
        logprobs_mode="scaled",  # what a trainer recomputes: logits / temperature
        worker_extension=WORKER_EXTENSION,
    )
    print(f"Loading {model.requested} on vLLM", flush=True)
    return build_vllm_engine(
        model.path,
        tokenizer_path=model.path,
        torch_dtype=cfg.model.torch_dtype,
        max_num_seqs=cfg.deploy.max_num_seqs,
        max_model_len=cfg.deploy.max_model_len,
        seed=i.seed,
        options=options,
    )


def serve(cfg: RolloutConfig, engine, model_name: str) -> None:
    from swiftlm.serve.app import ServerSettings, create_app
    from swiftlm.serve.metrics import GenerationMetrics
    from swiftlm.serve.routes.health import health_router
    from swiftlm.serve.routes.metrics import metrics_router
    from swiftlm.serve.routes.rollout import RolloutService, rollout_router

    d = cfg.deploy
    settings = ServerSettings(max_body_bytes=MAX_BODY_BYTES)
    metrics = GenerationMetrics(engine)
    service = RolloutService(engine, d.host, metrics, model_name)
    routers = [health_router(), metrics_router(metrics), rollout_router(service)]
    app = create_app(settings, metrics, routers)
    server = draining_server(app, d.host, d.port, d.shutdown_timeout)
    print(f"Rollout server for {model_name} at {url(d.host, d.port)}", flush=True)
    if d.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"Warning: --host {d.host}: anyone who reaches it can push weights", flush=True)
    server.run()
    if service.synced:  # a trainer still connected: its group goes before vLLM's workers
        service.close_sync()
