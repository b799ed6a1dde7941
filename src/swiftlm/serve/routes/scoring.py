"""A reward model's routes: POST /v1/score (serve.scoring), and the two generation paths."""

from fastapi import APIRouter

from swiftlm.serve.scoring import ScoreRequest, Scoring


def scoring_router(scoring: Scoring) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/score")
    async def score(body: ScoreRequest):
        return await scoring.score(body)

    # A client pointed at a reward model as at any OpenAI server gets a 400 that names the
    # route to use, not the bare 404 of a path that is not mounted.
    @router.post("/v1/chat/completions")
    @router.post("/v1/completions")
    async def no_generation():
        raise scoring.generation_refused()

    return router
