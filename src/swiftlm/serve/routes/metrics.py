"""GET /metrics: the server's Prometheus metrics (serve.metrics), in the text format."""

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from swiftlm.serve.metrics import ServerMetrics


def metrics_router(metrics: ServerMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router
