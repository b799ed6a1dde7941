"""POST /v1/completions, answered by serve.completions.Completions.complete."""

from fastapi import APIRouter, Request

from swiftlm.serve.completions import Completions
from swiftlm.serve.schemas import CompletionRequest


def completions_router(completions: Completions) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def text_completions(body: CompletionRequest, request: Request):
        return await completions.complete(body, request)

    return router
