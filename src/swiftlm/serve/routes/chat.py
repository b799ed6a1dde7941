"""POST /v1/chat/completions, answered by serve.completions.Completions.chat."""

from fastapi import APIRouter, Request

from swiftlm.serve.completions import Completions
from swiftlm.serve.schemas import ChatCompletionRequest


def chat_router(completions: Completions) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await completions.chat(body, request)

    return router
