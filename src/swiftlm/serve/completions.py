"""`POST /v1/chat/completions` and `POST /v1/completions`: validate, run on the engine, answer
whole or as a server-sent-event stream."""

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse

from swiftlm.engine.protocol import Engine, GenerationRequest, SampleDelta, SamplingParams
from swiftlm.engine.vision import VisionRequest
from swiftlm.serve import responses as r
from swiftlm.serve.errors import APIError, error_body
from swiftlm.serve.generation import (
    ClientDisconnected,
    DeltaStream,
    Limits,
    Sample,
    abort_all,
    admit,
    now_s,
    run_on_engine,
    submit,
)
from swiftlm.serve.metrics import GenerationMetrics, RequestTimer
from swiftlm.serve.schemas import ChatCompletionRequest, CompletionRequest
from swiftlm.serve.structured import Constraints
from swiftlm.serve.tools import template_tools, tool_message
from swiftlm.serve.translate import (
    ServedModels,
    chat_prompt_ids,
    check_sample_count,
    completion_prompts,
    reject_unsupported,
    sampling_params,
)
from swiftlm.serve.vision import reject_images, vision_prompt


@dataclass
class Job:
    """One HTTP request's work on the engine: its prompts, submitted and timed."""

    engine: Engine
    requests: list[GenerationRequest]
    limits: Limits
    metrics: GenerationMetrics
    model: str
    endpoint: str
    http: Request
    stream: DeltaStream = field(init=False)  # set by start()
    timer: RequestTimer = field(init=False)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(g.prompt_ids) for g in self.requests)

    @property
    def choices(self) -> int:
        return sum(g.params.n for g in self.requests)

    def start(self) -> "Job":
        """Queue the prompts, or answer 429 (queue full) / 400 (the engine refuses them) while
        the response status can still say so."""
        admit(self.engine, self.limits)
        self.stream = submit(self.engine, self.requests)
        self.timer = self.metrics.track(self.model, self.endpoint, self.prompt_tokens)
        return self

    async def deltas(self) -> AsyncIterator[tuple[int, SampleDelta]]:
        """(choice index, delta) of every sample; an error when a sample failed (400: the
        request's values, 500: the engine's failure) or the engine aborted it (503). The
        request's other samples are then aborted (run_on_engine)."""
        items = run_on_engine(
            self.engine, self.stream, self.limits, self.http.is_disconnected, self.timer.observe
        )
        async for choice, delta in items:
            if delta.finish_reason in ("abort", "error"):
                raise sample_error(delta)
            yield choice, delta
        self.timer.finish()

    def abort_unfinished(self) -> None:
        if self.stream.unfinished:
            abort_all(self.engine, self.stream)

    async def samples(self) -> list[Sample]:
        samples = [Sample(i) for i in range(self.choices)]
        try:
            async for choice, delta in self.deltas():
                samples[choice].add(delta)
        except ClientDisconnected:
            raise APIError(400, "the client disconnected before the answer was ready") from None
        return samples


class Completions:
    """The two generation routes of one app."""

    def __init__(self, engine, tokenizer, models: ServedModels, metrics, settings):
        self.engine = engine
        self.tokenizer = tokenizer
        self.models = models
        self.metrics = metrics
        self.settings = settings
        self.texts = r.TokenTexts(tokenizer)
        self.limits = Limits(settings.max_queued_requests, settings.request_timeout)
        # The grammar ends a constrained answer with one of the engine's end-of-turn tokens.
        stop_ids = getattr(engine, "stop_token_ids", None) or [tokenizer.eos_token_id]
        self.constraints = Constraints(tokenizer, stop_ids)
        # A vision-language model's engine (engine.vision) takes image parts.
        self.vision = getattr(engine, "vision", False)

    def _params(self, body, prompt_ids: list[int]) -> SamplingParams:
        max_model_len = self.engine.stats().max_model_len
        return sampling_params(body, len(prompt_ids), max_model_len, self.settings.max_n)

    def _job(
        self,
        body,
        http: Request,
        endpoint: str,
        prompts: list[list[int]],
        constraint=None,
        features: list[dict] | None = None,
    ) -> Job:
        """`features`: per prompt, the image features of a vision-language model's prompt."""
        adapter = self.models.adapter_for(body.model)
        requests = [
            GenerationRequest(ids, self._params(body, ids), adapter, constraint=constraint)
            if features is None
            else VisionRequest(ids, self._params(body, ids), adapter, features=features[i])
            for i, ids in enumerate(prompts)
        ]
        job = Job(self.engine, requests, self.limits, self.metrics, body.model, endpoint, http)
        return job.start()

    async def chat(self, body: ChatCompletionRequest, http: Request):
        reject_unsupported(body)
        self.models.adapter_for(body.model)  # 404 before any tokenizing
        # Off the event loop: rendering and tokenizing a long conversation takes a while.
        if self.vision:  # images decoded and processed here; a bad one is a 400
            prompt = await asyncio.to_thread(
                vision_prompt,
                self.engine,
                body,
                self.settings.system,
                self.settings.allow_local_images,
            )
            ids = prompt.ids
            job = self._job(body, http, "chat", [ids], features=[prompt.features])
        else:
            reject_images(body, body.model)
            ids = await asyncio.to_thread(
                chat_prompt_ids, self.tokenizer, body, self.settings.system
            )
            constraint = await asyncio.to_thread(
                self.constraints.for_request, body, self.settings.tool_call_parser
            )
            job = self._job(body, http, "chat", [ids], constraint)
        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", now_s()
        texts = self.texts if body.logprobs else None
        tools = template_tools(body) is not None  # answers may hold tool calls to parse
        if body.stream:
            events = self._chat_events(job, request_id, created, texts, body.include_usage())
            if tools:
                events = self._chat_tool_events(job, request_id, created, body.include_usage())
            return event_stream(events, job)
        samples = await job.samples()
        answer = r.chat_completion(request_id, body.model, created, samples, len(ids), texts)
        if tools:
            for choice in answer["choices"]:
                with_calls(choice, choice["message"]["content"], self.settings.tool_call_parser)
        return answer

    async def _chat_tool_events(self, job: Job, request_id, created, include_usage):
        """A streamed answer that may call tools: a call is only known once its closing tag
        is out, so each choice's text is held back and sent whole, as content or as
        tool_calls, in one chunk when the choice finishes."""
        texts: dict[int, str] = {}
        completion_tokens = 0
        async for choice, delta in job.deltas():
            completion_tokens += len(delta.token_ids)
            texts[choice] = texts.get(choice, "") + delta.text
            if delta.finish_reason is None:
                continue
            entry = with_calls(
                {"index": choice, "finish_reason": delta.finish_reason},
                texts[choice],
                self.settings.tool_call_parser,
            )
            message = entry.pop("message")
            if message.get("tool_calls"):
                message["tool_calls"] = [
                    {"index": i, **call} for i, call in enumerate(message["tool_calls"])
                ]
            entry["delta"] = message
            yield r.sse(r.chat_chunk(request_id, job.model, created, [entry]))
        if include_usage:
            usage = r.usage(job.prompt_tokens, completion_tokens)
            yield r.sse({**r.chat_chunk(request_id, job.model, created, []), "usage": usage})

    async def _chat_events(self, job: Job, request_id, created, texts, include_usage):
        def chunk(choices: list[dict]) -> str:
            return r.sse(r.chat_chunk(request_id, job.model, created, choices))

        opened: set[int] = set()  # choices whose first chunk (with the role) has gone out
        completion_tokens = 0
        async for choice, delta in job.deltas():
            completion_tokens += len(delta.token_ids)
            if choice not in opened:
                opened.add(choice)
                yield chunk([r.chat_chunk_choice(choice, {"role": "assistant", "content": ""})])
            if not (delta.text or delta.finish_reason or delta.logprobs):
                continue
            logprobs = r.chat_logprobs(delta.logprobs, texts) if texts else None
            content = {"content": delta.text} if delta.text else {}
            yield chunk([r.chat_chunk_choice(choice, content, logprobs, delta.finish_reason)])
        if include_usage:
            usage = r.usage(job.prompt_tokens, completion_tokens)
            yield r.sse({**r.chat_chunk(request_id, job.model, created, []), "usage": usage})

    async def complete(self, body: CompletionRequest, http: Request):
        reject_unsupported(body)
        if body.echo:
            raise APIError(400, "'echo': true is not supported", param="echo")
        self.models.adapter_for(body.model)
        check_sample_count(len(body.prompts()), body.n, self.settings.max_n)
        prompts = await asyncio.to_thread(completion_prompts, self.tokenizer, body)
        job = self._job(body, http, "completions", prompts)
        request_id, created = f"cmpl-{uuid.uuid4().hex}", now_s()
        logprobs = None if body.logprobs is None else (self.texts, body.logprobs)
        if body.stream:
            events = self._completion_events(job, request_id, created, logprobs, body)
            return event_stream(events, job)
        samples = await job.samples()
        return r.completion(request_id, body.model, created, samples, job.prompt_tokens, logprobs)

    async def _completion_events(self, job: Job, request_id, created, logprobs, body):
        completion_tokens = 0
        offsets = [0] * job.choices  # where each choice's next token starts in its text
        async for choice, delta in job.deltas():
            completion_tokens += len(delta.token_ids)
            if not (delta.text or delta.finish_reason or delta.logprobs):
                continue
            entry_logprobs = None
            if logprobs:
                entry_logprobs = r.completion_logprobs(delta.logprobs, *logprobs, offsets[choice])
                offsets[choice] += sum(len(t) for t in entry_logprobs["tokens"])
            entry = {
                "index": choice,
                "text": delta.text,
                "logprobs": entry_logprobs,
                "finish_reason": delta.finish_reason,
            }
            yield r.sse(r.completion_chunk(request_id, job.model, created, [entry]))
        if body.include_usage():
            usage = r.usage(job.prompt_tokens, completion_tokens)
            yield r.sse({**r.completion_chunk(request_id, job.model, created, []), "usage": usage})


def sample_error(delta: SampleDelta) -> APIError:
    """The error of a sample that failed or that the engine aborted (a caller's abort never
    reaches a reader: the reader is what aborts)."""
    if delta.finish_reason == "error" and delta.error_id is None:  # the request's own values
        return APIError(400, str(delta.error), code="invalid_request")
    where = f"error id {delta.error_id}, in the server log" if delta.error_id else "server log"
    if delta.finish_reason == "error":
        return APIError(
            500,
            f"generating this answer failed inside the server ({where}); the other requests "
            "were not affected, retrying may succeed",
            code="internal_error",
        )
    if delta.error:
        return APIError(
            503, f"the engine failed while generating ({where}); retry", code="engine_failed"
        )
    return APIError(503, "the request was aborted: the engine is shutting down")


def with_calls(choice: dict, text: str, parser: str) -> dict:
    """Set `choice`'s message from `text`: tool calls parsed out by `parser` (finish_reason
    "tool_calls", as OpenAI says when the model called tools), or the text as content."""
    message, called = tool_message(text, parser)
    choice["message"] = message
    if called and choice.get("finish_reason") == "stop":
        choice["finish_reason"] = "tool_calls"
    return choice


class JobStreamingResponse(StreamingResponse):
    """A stream that, however it ends, aborts what is left of its job in the engine: also when
    the client left before the first event, when the event generator never started (and so
    never ran its own cleanup)."""

    def __init__(self, content, job: Job, **kwargs):
        super().__init__(content, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.abort_unfinished()


def event_stream(events: AsyncIterator[str], job: Job) -> StreamingResponse:
    """Server-sent events ending with `data: [DONE]`. An error after the stream has started
    (a timeout, the engine stopping) can no longer change the status: it goes out as an
    error event, then [DONE]. A client that leaves ends the generator, which aborts the
    request in the engine."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except APIError as exc:
            yield r.sse(error_body(exc.status, exc.message, exc.param, exc.code))
        except ClientDisconnected:
            return
        yield r.sse("[DONE]")

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return JobStreamingResponse(guarded(), job, media_type="text/event-stream", headers=headers)
