"""The OpenAI-compatible app: `create_app(engine, tokenizer, models, settings)`.

Routes: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions` (whole answers
or server-sent events), `GET /health`, `GET /metrics`, and the chat page at `GET /`. Every route
but /health and / needs an API key when keys are set (the page holds no secret: it asks for the
key and sends it with its API calls); every error is an OpenAI error object (`errors.py`).
A vision-language model's chat route also takes image_url parts (`vision.py`); its engine is
infer.vision.VisionEngine (continuous batching is text-only).
"""

from dataclasses import dataclass
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from swiftlm.engine.protocol import Engine
from swiftlm.serve.completions import Completions
from swiftlm.serve.errors import install_error_handlers
from swiftlm.serve.generation import now_s
from swiftlm.serve.guard import Gate, ServerState
from swiftlm.serve.metrics import GenerationMetrics
from swiftlm.serve.schemas import ChatCompletionRequest, CompletionRequest
from swiftlm.serve.translate import ServedModels

MIB = 1024 * 1024
CHAT_PAGE = resources.files("swiftlm.serve").joinpath("static/chat.html").read_text("utf-8")


@dataclass(frozen=True)
class ServerSettings:
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = MIB
    max_queued_requests: int = 64
    max_n: int = 16
    request_timeout: float = 600.0
    system: str | None = None  # system prompt for conversations that have none
    allow_local_images: bool = False  # image_url parts may name files on this machine
    tool_call_parser: str = "hermes"  # a name in serve.tools.TOOL_PARSERS


def create_app(
    engine: Engine, tokenizer, models: ServedModels, settings: ServerSettings
) -> FastAPI:
    """The app over a running engine; `app.state.server.draining = True` turns new requests
    away with 503 (graceful shutdown)."""
    # No /docs or /openapi.json: fewer routes to guard, and the API is OpenAI's, documented.
    app = FastAPI(title="swiftlm", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = GenerationMetrics(engine)
    state = ServerState(settings.api_keys, settings.max_body_bytes)
    app.state.server = state
    app.state.metrics = metrics
    install_error_handlers(app)
    completions = Completions(engine, tokenizer, models, metrics, settings)
    created = now_s()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/")
    async def chat_page():
        return HTMLResponse(CHAT_PAGE)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        max_model_len = engine.stats().max_model_len
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "swiftlm",
                "root": models.base,
                "parent": None if name == models.base else models.base,
                "max_model_len": max_model_len,
            }
            for name in models.names()
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await completions.chat(body, request)

    @app.post("/v1/completions")
    async def text_completions(body: CompletionRequest, request: Request):
        return await completions.complete(body, request)

    app.add_middleware(Gate, state=state, on_status=metrics.count_response)
    return app
