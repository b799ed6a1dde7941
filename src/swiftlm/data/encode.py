"""Turn canonical samples into token ids and loss labels.

Chat samples are rendered with the tokenizer's own chat template. The assistant spans are
found by rendering growing prefixes of the conversation: the text of turn k is whatever
rendering `messages[:k+1]` adds to rendering `messages[:k]` with the generation prompt. That
works for any template where a conversation's rendering extends its prefixes' (true for
ChatML, Llama 3, Mistral, SmolLM, Qwen2 ...), and needs no per-model code. A template that
rewrites earlier turns (e.g. strips past reasoning) is reported, not silently mis-masked.
"""

from collections import Counter
from dataclasses import dataclass, field

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


def assistant_char_spans(tokenizer, messages: list[dict], scope: str) -> tuple[str, list]:
    """Render a conversation and return (text, [(start, end) char spans that carry loss])."""
    text = _render(tokenizer, messages, add_generation_prompt=False)
    if scope == "all":
        return text, [(0, len(text))]
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


def encode_chat(tokenizer, messages: list[dict], scope: str = "assistant") -> dict:
    """Token ids and labels (IGNORE_INDEX outside loss spans) for one conversation."""
    text, spans = assistant_char_spans(tokenizer, messages, scope)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = []
    for token_id, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True):
        inside = any(s <= start and end <= e and end > start for s, e in spans)
        labels.append(token_id if inside else IGNORE_INDEX)
    return {"input_ids": list(encoded["input_ids"]), "labels": labels}


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
    encoded = []
    for sample in samples:
        try:
            item = encode_chat(tokenizer, sample["messages"], scope)
        except DataError as exc:
            raise DataError(f"{sample.get('source', 'sample')}: {exc}") from None
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
