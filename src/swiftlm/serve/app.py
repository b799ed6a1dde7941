"""The app of `swiftlm deploy`: one factory, `create_app(settings, metrics, routers)`, and the
routers each kind of model mounts (serve.routes, one router per endpoint group).

- `generation_app(engine, tokenizer, models, settings)`: `GET /v1/models`,
  `POST /v1/chat/completions`, `POST /v1/completions` (whole answers or server-sent events),
  `GET /health`, `GET /metrics`, and the chat page at `GET /`. A vision-language model's chat
  route also takes image_url parts (`vision.py`); its engine is engine.vision.VisionEngine
  (continuous batching is text-only).
- `scoring_app(scorer, models, settings)`: a reward model's `POST /v1/score` (`scoring.py`),
  `GET /v1/models`, `GET /health`, `GET /metrics`; no generation.

Every route but /health and / needs an API key when keys are set (the page holds no secret: it
asks for the key and sends it with its API calls); every error is an OpenAI error object
(`errors.py`). Both come from the app, not from a router, so every server has them.
"""

from collections.abc import Iterable
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI

from swiftlm.engine.protocol import Engine
from swiftlm.engine.score import RewardScorer
from swiftlm.serve.completions import Completions
from swiftlm.serve.errors import install_error_handlers
from swiftlm.serve.guard import Gate, ServerState
from swiftlm.serve.metrics import GenerationMetrics, ScoringMetrics, ServerMetrics
from swiftlm.serve.routes.chat import chat_router
from swiftlm.serve.routes.completions import completions_router
from swiftlm.serve.routes.health import health_router
from swiftlm.serve.routes.metrics import metrics_router
from swiftlm.serve.routes.models import models_router
from swiftlm.serve.routes.page import page_router
from swiftlm.serve.routes.scoring import scoring_router
from swiftlm.serve.scoring import Scoring
from swiftlm.serve.translate import ServedModels

MIB = 1024 * 1024


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
    settings: ServerSettings, metrics: ServerMetrics, routers: Iterable[APIRouter]
) -> FastAPI:
    """The app serving `routers`, behind the gate (drain, API keys, body size, 500s; its
    responses counted in `metrics`) and the OpenAI error objects;
    `app.state.server.draining = True` turns new requests away with 503 (graceful shutdown)."""
    # No /docs or /openapi.json: fewer routes to guard, and the API is OpenAI's, documented.
    app = FastAPI(title="swiftlm", docs_url=None, redoc_url=None, openapi_url=None)
    state = ServerState(settings.api_keys, settings.max_body_bytes)
    app.state.server = state
    install_error_handlers(app)
    for router in routers:
        app.include_router(router)
    app.add_middleware(Gate, state=state, on_status=metrics.count_response)
    return app


def generation_app(
    engine: Engine, tokenizer, models: ServedModels, settings: ServerSettings
) -> FastAPI:
    """The OpenAI-compatible server over a running generation engine."""
    metrics = GenerationMetrics(engine)
    completions = Completions(engine, tokenizer, models, metrics, settings)
    routers = [
        health_router(),
        page_router(),
        metrics_router(metrics),
        models_router(models.names(), models.base, lambda: engine.stats().max_model_len),
        chat_router(completions),
        completions_router(completions),
    ]
    return create_app(settings, metrics, routers)


def scoring_app(scorer: RewardScorer, models: ServedModels, settings: ServerSettings) -> FastAPI:
    """The server over a loaded reward model: one model (its adapters merged in, engine.score),
    listed under the base name."""
    metrics = ScoringMetrics()
    scoring = Scoring(scorer, models, settings.system, metrics)
    routers = [
        health_router(),
        metrics_router(metrics),
        models_router([models.base], models.base, lambda: scorer.max_length, task="score"),
        scoring_router(scoring),
    ]
    return create_app(settings, metrics, routers)
