"""GET /v1/models: OpenAI's model list, with vLLM's `root`, `parent` and `max_model_len`."""

from collections.abc import Callable, Sequence

from fastapi import APIRouter

from swiftlm.serve.generation import now_s


def models_router(
    names: Sequence[str],
    base: str,
    max_model_len: Callable[[], int],
    task: str | None = None,
) -> APIRouter:
    """`names`: the models listed (an adapter's parent is `base`); `task`: what a model that
    does not generate is for (a reward model's "score"), so that a client can tell."""
    router = APIRouter()
    created = now_s()

    @router.get("/v1/models")
    async def list_models():
        length = max_model_len()
        data = [model_card(name, base, created, length, task) for name in names]
        return {"object": "list", "data": data}

    return router


def model_card(name: str, base: str, created: int, max_model_len: int, task: str | None) -> dict:
    card = {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "swiftlm",
        "root": base,
        "parent": None if name == base else base,
        "max_model_len": max_model_len,
    }
    return card if task is None else {**card, "task": task}
