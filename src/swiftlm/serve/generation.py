"""Run one request on the engine from the event loop: admission, deltas, timeout, disconnect.

The engine calls `on_delta` on its own thread; `DeltaStream` hands each delta to the event
loop through a queue. Whatever ends the consumer (the answer is complete, the client went
away, the time ran out, the server is stopping), the request is aborted in the engine unless
all its samples have finished, so its batch slots are freed at the next step.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from swiftlm.engine.protocol import Engine, GenerationRequest, SampleDelta, TokenLogprob
from swiftlm.serve.errors import APIError

# How often a consumer waiting for tokens checks whether its client is still connected.
DISCONNECT_POLL_S = 0.5


class ClientDisconnected(Exception):
    pass


class DeltaStream:
    """The deltas of one HTTP request's engine requests (one per prompt), from the engine
    thread to the event loop, each tagged with its choice index: the sample's index plus the
    `offset` of its engine request."""

    def __init__(self, samples: int):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, SampleDelta]] = asyncio.Queue()
        self.unfinished = samples
        self.request_ids: list[str] = []

    def callback(self, offset: int) -> Callable[[SampleDelta], None]:
        def on_delta(delta: SampleDelta) -> None:  # called on the engine thread
            try:
                item = (offset + delta.index, delta)
                self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
            except RuntimeError:  # the event loop has closed: nobody is left to read it
                pass

        return on_delta

    async def deltas(
        self, deadline: float, is_disconnected: Callable[[], Awaitable[bool]]
    ) -> AsyncIterator[tuple[int, SampleDelta]]:
        """(choice index, delta) until every sample has finished; `TimeoutError` past
        `deadline` (loop time), `ClientDisconnected` when the client has gone."""
        next_check = self._loop.time() + DISCONNECT_POLL_S
        while self.unfinished:
            now = self._loop.time()
            if now >= deadline:
                raise TimeoutError
            if now >= next_check:
                if await is_disconnected():
                    raise ClientDisconnected
                next_check = now + DISCONNECT_POLL_S
            wait = min(deadline, next_check) - now
            try:
                choice, delta = await asyncio.wait_for(self._queue.get(), wait)
            except asyncio.TimeoutError:
                continue
            if delta.finish_reason is not None:
                self.unfinished -= 1
            yield choice, delta


@dataclass
class Sample:
    """One sample's output, collected from its deltas."""

    index: int  # the choice index
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: SampleDelta) -> None:
        self.token_ids += delta.token_ids
        self.text += delta.text
        self.logprobs += delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason


@dataclass
class Limits:
    max_queued_requests: int
    request_timeout: float
    retry_after_s: int = 1


def admit(engine: Engine, limits: Limits) -> None:
    """429 with Retry-After when the engine's queue is full."""
    waiting = engine.stats().waiting
    if waiting >= limits.max_queued_requests:
        raise APIError(
            429,
            f"the server is busy: {waiting} requests are waiting (--max_queued_requests "
            f"{limits.max_queued_requests}); retry shortly",
            code="queue_full",
            headers={"Retry-After": str(limits.retry_after_s)},
        )


def submit(engine: Engine, requests: list[GenerationRequest]) -> DeltaStream:
    """Queue `requests` (the prompts of one HTTP request, each with n samples); the engine's
    own refusals (a ValueError) become a 400, and what was queued already is aborted."""
    stream = DeltaStream(sum(r.params.n for r in requests))
    offset = 0
    for request in requests:
        try:
            engine.submit(request, stream.callback(offset))
        except ValueError as exc:
            abort_all(engine, stream)
            raise APIError(400, str(exc), code="invalid_request") from None
        except RuntimeError as exc:  # the engine has been shut down
            abort_all(engine, stream)
            raise APIError(503, f"the engine is not running: {exc}") from None
        stream.request_ids.append(request.request_id)
        offset += request.params.n
    return stream


def abort_all(engine: Engine, stream: DeltaStream) -> None:
    for request_id in stream.request_ids:
        engine.abort(request_id)


async def run_on_engine(
    engine: Engine,
    stream: DeltaStream,
    limits: Limits,
    is_disconnected: Callable[[], Awaitable[bool]],
    on_delta: Callable[[int, SampleDelta], None],
) -> AsyncIterator[tuple[int, SampleDelta]]:
    """(choice index, delta) of submitted requests; they are aborted in the engine if the
    consumer stops early (a disconnect, the timeout, a closed stream)."""
    deadline = asyncio.get_running_loop().time() + limits.request_timeout
    try:
        async for item in stream.deltas(deadline, is_disconnected):
            on_delta(*item)
            yield item
    except TimeoutError:
        raise APIError(
            504,
            f"the request ran longer than --request_timeout {limits.request_timeout:g} s "
            "and was aborted",
            code="request_timeout",
        ) from None
    finally:
        if stream.unfinished:
            abort_all(engine, stream)


def now_s() -> int:
    return int(time.time())
