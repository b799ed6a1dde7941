"""`POST /v1/score`, what `swiftlm deploy` serves for a reward model (`swiftlm rlhf --rlhf_type
rm`) beside /v1/models, /health and /metrics (serve.app.scoring_app mounts them); no generation.

A reward model has a score head instead of a language-model head, so it is loaded without a
generation engine (`engine/score.py`) and the generation routes answer 400, naming the route
to use. The request (vLLM's `/score` response shape, OpenAI's error objects):

    POST /v1/score
    {"model": "my-rm", "messages": [{"role": "user", "content": "..."},
                                    {"role": "assistant", "content": "..."}]}
    or, several conversations in one call:
    {"model": "my-rm", "input": [[...messages...], [...messages...]]}

Exactly one of `messages` and `input`; each conversation ends with the assistant answer to
score (a server --system prompt is added to one without a system message, as in generation).
The answer:

    {"object": "list", "model": "my-rm",
     "data": [{"object": "score", "index": 0, "score": 1.84}, ...],
     "usage": {"prompt_tokens": 52, "total_tokens": 52}}
"""

from typing import Literal

from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict

from swiftlm.data.rows import RowError
from swiftlm.engine.score import RewardScorer, score_sample
from swiftlm.serve.errors import APIError
from swiftlm.serve.metrics import ScoringMetrics
from swiftlm.serve.schemas import TextPart
from swiftlm.serve.translate import ServedModels

MAX_CONVERSATIONS = 256  # per request: a bigger batch is many calls' worth of one forward


class ScoreMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_dict(self) -> dict:
        role = "system" if self.role == "developer" else self.role
        text = (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )
        return {"role": role, "content": text}


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[ScoreMessage] | None = None
    input: list[list[ScoreMessage]] | None = None

    def conversations(self) -> tuple[list[list[dict]], str]:
        """(the conversations to score, the field they came from); 400 unless exactly one of
        `messages` and `input` is given."""
        if (self.messages is None) == (self.input is None):
            raise APIError(
                400,
                "give exactly one of 'messages' (one conversation) and 'input' (a list of "
                "conversations)",
                param="messages",
            )
        if self.messages is not None:
            return [[m.as_dict() for m in self.messages]], "messages"
        if not self.input or len(self.input) > MAX_CONVERSATIONS:
            raise APIError(
                400, f"'input': give 1 to {MAX_CONVERSATIONS} conversations", param="input"
            )
        return [[m.as_dict() for m in c] for c in self.input], "input"


def prompt_ids(scorer: RewardScorer, request: ScoreRequest, system: str | None) -> list[list[int]]:
    """Each conversation checked (roles, order, the answer last) and encoded; 400 naming the
    conversation when one cannot be scored."""
    conversations, field = request.conversations()
    rows = []
    for index, messages in enumerate(conversations):
        param = field if field == "messages" else f"input.{index}"
        try:
            messages = score_sample({"messages": messages}, system)["messages"]
        except RowError as exc:
            raise APIError(400, f"'{param}': {exc}", param=param) from None
        ids = scorer.encode(messages)
        problem = scorer.too_long(ids)
        if problem:
            raise APIError(
                400, f"'{param}': {problem}", param=param, code="context_length_exceeded"
            )
        rows.append(ids)
    return rows


class Scoring:
    """What a reward model's routes (serve.routes.scoring) do: score, and refuse to generate."""

    def __init__(
        self,
        scorer: RewardScorer,
        models: ServedModels,
        system: str | None,
        metrics: ScoringMetrics,
    ):
        self.scorer = scorer
        self.models = models
        self.system = system  # the server's --system prompt, as in generation
        self.metrics = metrics

    async def score(self, body: ScoreRequest) -> dict:
        self.models.adapter_for(body.model)  # 404 for a name that is not served
        rows = prompt_ids(self.scorer, body, self.system)
        scores = await run_in_threadpool(self.scorer.score_ids, rows)
        count = sum(map(len, rows))
        self.metrics.count_scored(body.model, len(rows), count)
        data = [{"object": "score", "index": i, "score": s} for i, s in enumerate(scores)]
        usage = {"prompt_tokens": count, "total_tokens": count}
        return {"object": "list", "data": data, "model": body.model, "usage": usage}

    def generation_refused(self) -> APIError:
        return APIError(
            400,
            f"The model '{self.models.base}' is a reward model: it scores conversations and "
            "cannot generate; send them to POST /v1/score",
            param="model",
            code="model_not_generative",
        )
