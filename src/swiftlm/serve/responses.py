"""OpenAI response bodies and stream chunks, built from the engine's samples and deltas."""

import json
from collections.abc import Sequence

from swiftlm.engine.protocol import TokenLogprob
from swiftlm.serve.generation import Sample


class TokenTexts:
    """Token id -> its text, decoded once. A byte-level token may hold part of a UTF-8
    character; its text then shows U+FFFD, which is why OpenAI also reports `bytes`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(payload: dict | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


# ---- chat ------------------------------------------------------------------------------------


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> dict:
    """`choices[i].logprobs` of a chat answer: `{"content": [{token, logprob, bytes,
    top_logprobs}]}`."""

    def one(token_id: int, logprob: float) -> dict:
        token = texts(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    content = [
        {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
        for e in entries
    ]
    return {"content": content}


def chat_completion(
    request_id: str,
    model: str,
    created: int,
    samples: list[Sample],
    prompt_tokens: int,
    texts: TokenTexts | None,
) -> dict:
    """A whole `chat.completion`; `texts` is given when the request asked for logprobs."""
    choices = [
        {
            "index": s.index,
            "message": {"role": "assistant", "content": s.text},
            "logprobs": chat_logprobs(s.logprobs, texts) if texts else None,
            "finish_reason": s.finish_reason,
        }
        for s in samples
    ]
    completion_tokens = sum(len(s.token_ids) for s in samples)
    whole = envelope("chat.completion", request_id, model, created, choices)
    return {**whole, "usage": usage(prompt_tokens, completion_tokens)}


def envelope(kind: str, request_id: str, model: str, created: int, choices: list[dict]) -> dict:
    """The fields every OpenAI response and stream chunk of one request shares."""
    return {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
    }


def chat_chunk(request_id: str, model: str, created: int, choices: list[dict]) -> dict:
    return envelope("chat.completion.chunk", request_id, model, created, choices)


def chat_chunk_choice(
    index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None
) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


# ---- completions -----------------------------------------------------------------------------


def completion_logprobs(
    entries: Sequence[TokenLogprob], texts: TokenTexts, top: int, start: int = 0
) -> dict:
    """`choices[i].logprobs` of a text completion: parallel lists, offsets into the text (a
    stream chunk's offsets continue from `start`, where the previous chunk ended)."""
    tokens = [texts(e.token_id) for e in entries]
    offsets, position = [], start
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{texts(t): lp for t, lp in e.top} for e in entries] if top else None,
        "text_offset": offsets,
    }


def completion(
    request_id: str,
    model: str,
    created: int,
    samples: list[Sample],
    prompt_tokens: int,
    logprobs: tuple[TokenTexts, int] | None,
) -> dict:
    """A whole `text_completion`; `logprobs` is (texts, alternatives) when asked for."""
    choices = [
        {
            "index": s.index,
            "text": s.text,
            "logprobs": completion_logprobs(s.logprobs, *logprobs) if logprobs else None,
            "finish_reason": s.finish_reason,
        }
        for s in samples
    ]
    whole = envelope("text_completion", request_id, model, created, choices)
    return {**whole, "usage": usage(prompt_tokens, sum(len(s.token_ids) for s in samples))}


def completion_chunk(request_id: str, model: str, created: int, choices: list[dict]) -> dict:
    # OpenAI names completion stream chunks `text_completion` too.
    return envelope("text_completion", request_id, model, created, choices)
