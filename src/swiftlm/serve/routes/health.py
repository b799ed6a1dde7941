"""GET /health: what a load balancer or orchestrator probes, without credentials
(serve.auth.PUBLIC_PATHS); a draining server answers it 503 like every route (serve.guard)."""

from fastapi import APIRouter


def health_router() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        return {"status": "ok"}

    return router
