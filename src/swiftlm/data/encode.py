"""Turn canonical samples into token ids and loss labels.

Chat samples are rendered with the tokenizer's own chat template. The assistant spans are
found by rendering growing prefixes of the conversation: the text of turn k is whatever
rendering `messages[:k+1]` adds to rendering `messages[:k]` with the generation prompt. That
works for any template where a conversation's rendering extends its prefixes' (true for
ChatML, Llama 3, Mistral, SmolLM, Qwen2 ...), and needs no per-model code. A template that
rewrites earlier turns (e.g. strips past reasoning) is reported, not silently mis-masked.

Content given as a list of text parts is flattened to its string first, so it renders exactly
like the equivalent string, also with templates that only handle string content.
"""

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from swiftlm.data.formats import content_images, flatten_text_parts
from swiftlm.errors import DataError
from swiftlm.models.templates import end_of_turn_token

IGNORE_INDEX = -100


@dataclass
class TruncationReport:
    """What happened to over-long samples."""

    strategy: str
    max_length: int
    counts: Counter = field(default_factory=Counter)  # "deleted" / "truncated" / "no labels left"

    def summary(self) -> str:
        if not self.counts:
            return ""
        parts = ", ".join(f"{n} {what}" for what, n in sorted(self.counts.items()))
        return f"samples longer than --max_length {self.max_length} ({self.strategy}): {parts}"


def _text_messages(messages: list[dict]) -> list[dict]:
    """Messages with string contents only (text parts flattened); images are refused."""
    flat = flatten_text_parts(messages)
    for index, message in enumerate(flat, start=1):
        if not isinstance(message["content"], str):
            count = len(content_images(message["content"]))
            raise DataError(
                f"message {index} has {count} image(s), which text-only chat encoding "
                "cannot use; remove its image parts"
            )
    return flat


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _trim_span_end(text: str, start: int, end: int, end_of_turn: str) -> int:
    """End the trained span right after the end-of-turn token (not the newline after it)."""
    cut = text.rfind(end_of_turn, start, end) if end_of_turn else -1
    if cut >= 0:
        return cut + len(end_of_turn)
    return start + len(text[start:end].rstrip())


def assistant_char_spans(
    tokenizer, messages: list[dict], scope: str, end_of_turn: str | None = None
) -> tuple[str, list]:
    """Render a conversation and return (text, [(start, end) char spans that carry loss])."""
    messages = _text_messages(messages)
    text = _render(tokenizer, messages, add_generation_prompt=False)
    if scope == "all":
        return text, [(0, len(text))]
    if end_of_turn is None:
        end_of_turn = end_of_turn_token(tokenizer)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:k], add_generation_prompt=True)
        upto = _render(tokenizer, messages[: k + 1], add_generation_prompt=False)
        if not (upto.startswith(prompt) and text.startswith(upto)):
            raise DataError(
                "the chat template re-renders earlier turns differently, so assistant spans "
                "cannot be located; use --loss_scope last_turn or a template without that rewrite"
            )
        spans.append((len(prompt), _trim_span_end(upto, len(prompt), len(upto), end_of_turn)))
    if scope == "last_turn":
        spans = spans[-1:]
    return text, spans


def _labels(ids: list[int], offsets: list, spans: list[tuple[int, int]]) -> list[int]:
    """A token's own id where it lies inside a loss span, IGNORE_INDEX elsewhere."""
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    start, end = bounds[:, 0], bounds[:, 1]
    inside = np.zeros(len(ids), dtype=bool)
    for s, e in spans:
        inside |= (s <= start) & (end <= e) & (end > start)
    return np.where(inside, np.asarray(ids, dtype=np.int64), IGNORE_INDEX).tolist()


def encode_chat(tokenizer, messages: list[dict], scope: str = "assistant") -> dict:
    """Token ids and labels (IGNORE_INDEX outside loss spans) for one conversation."""
    text, spans = assistant_char_spans(tokenizer, messages, scope)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    return {"input_ids": ids, "labels": _labels(ids, encoded["offset_mapping"], spans)}


# Conversations tokenized per call: the fast tokenizer encodes a batch on all cores.
TOKENIZE_BATCH = 1024


def _encode_chat_batch(tokenizer, samples: list[dict], scope: str, end_of_turn: str) -> list:
    rendered = []
    for sample in samples:
        try:
            rendered.append(assistant_char_spans(tokenizer, sample["messages"], scope, end_of_turn))
        except DataError as exc:
            raise DataError(f"{sample.get('source', 'sample')}: {exc}") from None
    encoded = tokenizer(
        [text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True
    )
    return [
        {"input_ids": list(ids), "labels": _labels(ids, offsets, spans)}
        for ids, offsets, (_, spans) in zip(
            encoded["input_ids"], encoded["offset_mapping"], rendered, strict=True
        )
    ]


def truncate(sample: dict, max_length: int, strategy: str, report: TruncationReport) -> dict | None:
    """Apply --truncation_strategy; None means the sample is dropped."""
    ids, labels = sample["input_ids"], sample["labels"]
    if len(ids) <= max_length:
        return sample
    if strategy == "delete":
        report.counts["deleted"] += 1
        return None
    keep = slice(-max_length, None) if strategy == "left" else slice(0, max_length)
    ids, labels = ids[keep], labels[keep]
    if all(label == IGNORE_INDEX for label in labels):
        report.counts["dropped (no answer tokens left)"] += 1
        return None
    report.counts["truncated"] += 1
    return {"input_ids": ids, "labels": labels}


def encode_chat_samples(
    tokenizer, samples: list[dict], max_length: int, strategy: str, scope: str
) -> tuple[list[dict], TruncationReport]:
    """Encode chat samples; over-long ones follow `strategy` and are counted."""
    report = TruncationReport(strategy, max_length)
    end_of_turn = end_of_turn_token(tokenizer)
    encoded = []
    for start in range(0, len(samples), TOKENIZE_BATCH):
        batch = samples[start : start + TOKENIZE_BATCH]
        for item in _encode_chat_batch(tokenizer, batch, scope, end_of_turn):
            item = truncate(item, max_length, strategy, report)
            if item is not None:
                encoded.append(item)
    if not encoded:
        raise DataError(
            f"no sample fits --max_length {max_length} with --truncation_strategy {strategy}; "
            "raise --max_length or use --truncation_strategy left/right"
        )
    return encoded, report


def encode_pretraining(tokenizer, texts: list[str], max_length: int) -> list[dict]:
    """Concatenate documents with an end-of-text separator and cut into max_length chunks.

    Every token carries loss. The last chunk may be shorter than max_length.
    """
    separator = tokenizer.eos_token_id
    if separator is None:
        raise DataError("the tokenizer has no EOS token to separate documents for pre-training")
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        stream.append(separator)
    chunks = [stream[i : i + max_length] for i in range(0, len(stream), max_length)]
    # A 1-token chunk has nothing to predict.
    return [{"input_ids": c, "labels": list(c)} for c in chunks if len(c) > 1]
