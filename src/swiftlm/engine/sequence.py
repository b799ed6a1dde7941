"""One sample being generated: its tokens, text, stop rules and where its deltas go."""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from swiftlm.engine.detokenize import IncrementalText, StopText
from swiftlm.engine.protocol import GenerationRequest, SampleDelta, TokenLogprob
from swiftlm.engine.sampling import RowState
from swiftlm.engine.speculation import DraftBackoff

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    request: GenerationRequest
    index: int  # which of the request's n samples
    on_delta: Callable[[SampleDelta], None]
    row: RowState
    detokenizer: IncrementalText
    stop_text: StopText
    max_new_tokens: int  # max_tokens, lowered where the context would run out
    stop_token_ids: frozenset[int]  # the model's end-of-turn ids and the request's own
    finish_reason: str | None = None
    last_token: int = -1  # the next decode step's input
    failed_callback: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)
    draft_backoff: DraftBackoff = field(default_factory=DraftBackoff)  # speculative decoding

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def adapter(self) -> str | None:
        return self.request.adapter

    @property
    def position(self) -> int:
        """Position id of `last_token`: the tokens before it in this sequence."""
        return len(self.row.prompt_ids) + len(self.row.output_ids) - 1

    def accept(self, token: int, logprob: TokenLogprob | None) -> SampleDelta:
        """Add a generated token; return the delta to send (with finish_reason if it ended)."""
        self.row.output_ids.append(token)
        self.last_token = token
        if logprob is not None:
            self.logprobs.append(logprob)
        text = self._text_of(token)
        if self.finish_reason is None and len(self.row.output_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            text += self.stop_text.flush()  # held-back text that no stop string completed
        logprobs = (logprob,) if logprob is not None else ()
        return self._delta((token,), text, logprobs)

    def _text_of(self, token: int) -> str:
        matcher = self.row.matcher
        if matcher is not None:
            if not matcher.accept(token):
                # Cannot happen while the mask holds; end the sample rather than emit text
                # the grammar forbids.
                log.error("request %s: the grammar refused token %d", self.request_id, token)
                self.finish_reason = "stop"
                return ""
            if matcher.is_terminated():  # it took the grammar's stop token: the answer is done
                self.finish_reason = "stop"
                return ""
        if token in self.stop_token_ids:
            self.finish_reason = "stop"
            return ""  # an end-of-turn token ends the answer; it is not part of the text
        text = self.stop_text.push(self.detokenizer.add(token))
        if self.stop_text.stopped:
            self.finish_reason = "stop"
        return text

    def abort(self, error: str | None = None, error_id: str | None = None) -> SampleDelta:
        self.finish_reason = "abort"
        return self._delta((), self.stop_text.flush(), (), error, error_id)

    def fail(self, error: str, error_id: str | None) -> SampleDelta:
        """End this sample alone: `error` says why (`error_id`: the engine's failure, logged)."""
        self.finish_reason = "error"
        # Held-back text is dropped, not flushed: it may be the start of a stop string, and
        # the answer ends where it failed anyway.
        return self._delta((), "", (), error, error_id)

    def _delta(self, token_ids, text, logprobs, error=None, error_id=None) -> SampleDelta:
        return SampleDelta(
            self.request_id,
            self.index,
            token_ids,
            text,
            logprobs,
            self.finish_reason,
            error,
            error_id,
        )
