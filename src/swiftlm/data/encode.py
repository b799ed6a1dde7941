"""Turn canonical samples into token ids and loss labels.

Chat samples are rendered with the tokenizer's own chat template. The assistant spans are
found by rendering growing prefixes of the conversation: the text of turn k is whatever
rendering `messages[:k+1]` adds to rendering `messages[:k]` with the generation prompt. That
works for any template where a conversation's rendering extends its prefixes' (true for
ChatML, Llama 3, Mistral, SmolLM, Qwen2 ...), and needs no per-model code. A template that
rewrites earlier turns (e.g. strips past reasoning) is reported, not silently mis-masked.

Content given as a list of text parts is flattened to its string first, so it renders exactly
like the equivalent string, also with templates that only handle string content.

Tool-calling samples render through the template's own tool support (`tools=` and the
assistant messages' `tool_calls`); the assistant turns holding calls are trained like answers,
tool results are not. A template that ignores the tools or the calls is refused.

A sample must keep at least one label token that a previous token predicts: one without is
dropped and counted, whatever dropped its labels, and data without any is an error.
"""

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from swiftlm.data.parts import content_images, flatten_text_parts
from swiftlm.data.tools import tool_call_names
from swiftlm.errors import DataError
from swiftlm.models.templates import end_of_turn_token

IGNORE_INDEX = -100


@dataclass
class TruncationReport:
    """What happened to over-long samples and to samples left without label tokens."""

    strategy: str
    max_length: int
    # "deleted", "truncated", "dropped (no label tokens left)", "dropped (no label tokens)"
    counts: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        if not self.counts:
            return ""
        return f"--max_length {self.max_length} --truncation_strategy {self.strategy}: {self}"

    def __str__(self) -> str:
        return ", ".join(f"{n} {what}" for what, n in sorted(self.counts.items()))

    def as_dict(self) -> dict:
        """The counts as plain JSON values: kept with the tokenized-data cache so a cached run
        reports the same numbers (data health), and zeros included so a clean run says so."""
        c = self.counts
        left = c["dropped (no label tokens left)"]
        return {
            "max_length": self.max_length,
            "strategy": self.strategy,
            "truncated": c["truncated"],
            # a vision sample that truncation would cut through an image is deleted too
            "deleted": sum(n for what, n in c.items() if what.startswith("deleted")),
            "dropped": c["dropped (no label tokens)"] + left,
            "dropped_after_truncation": left,
        }


def _text_messages(messages: list[dict], images: bool = False) -> list[dict]:
    """Messages with text parts flattened to strings; image parts are refused unless
    `images` (a vision-language model's processor template renders them)."""
    flat = flatten_text_parts(messages)
    if images:
        return flat
    for index, message in enumerate(flat, start=1):
        if not isinstance(message["content"], str):
            count = len(content_images(message["content"]))
            raise DataError(
                f"message {index} has {count} image(s), which text-only chat encoding "
                "cannot use; remove its image parts"
            )
    return flat


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools=None) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )


# swiftlm renders with the model's own chat template (no --template flag yet).
TOOL_TEMPLATE_FIX = (
    "use a model whose chat template supports tools, e.g. Qwen2.5-Instruct (swiftlm renders "
    "every row with the model's own chat template)"
)


def check_tools_rendered(tokenizer, messages: list[dict], tools: list | None, text: str) -> None:
    """Refuse a chat template that drops the tools or the tool calls of a conversation.

    Training on it would teach answers to tools the model never saw, or would leave the calls
    out of the targets. `text` is the conversation rendered with `tools`. Only the first
    assistant turn with calls is compared: a template treats them all alike.
    """
    if tools and _render(tokenizer, messages, False) == text:
        raise DataError(
            "the row has a 'tools' list, but this model's chat template does not render tools "
            f"(the text is the same with and without them); {TOOL_TEMPLATE_FIX}, or remove "
            "the 'tools' column"
        )
    index = next((i for i, m in enumerate(messages) if m.get("tool_calls")), None)
    if index is not None and not _renders_calls(tokenizer, messages[: index + 1], tools):
        names = ", ".join(repr(name) for name in tool_call_names(messages[index]))
        raise DataError(
            f"the assistant turn calling {names} loses its call in this model's chat template "
            f"(the text is the same with and without it), so the call would not be trained; "
            f"{TOOL_TEMPLATE_FIX}"
        )


def _renders_calls(tokenizer, messages: list[dict], tools: list | None) -> bool:
    """Whether the last message's tool calls change the rendered text."""
    last = {key: value for key, value in messages[-1].items() if key != "tool_calls"}
    try:
        without = _render(tokenizer, [*messages[:-1], last], False, tools)
    except Exception:  # noqa: BLE001 - a template that needs the calls there does render them
        return True
    return without != _render(tokenizer, messages, False, tools)


def _trim_span_end(text: str, start: int, end: int, end_of_turn: str) -> int:
    """End the trained span right after the end-of-turn token (not the newline after it)."""
    cut = text.rfind(end_of_turn, start, end) if end_of_turn else -1
    if cut >= 0:
        return cut + len(end_of_turn)
    return start + len(text[start:end].rstrip())


def assistant_char_spans(
    tokenizer,
    messages: list[dict],
    scope: str,
    end_of_turn: str | None = None,
    tools: list | None = None,
    images: bool = False,
) -> tuple[str, list]:
    """Render a conversation and return (text, [(start, end) char spans that carry loss]).

    `images`: image parts are rendered by the template (as the model's image placeholder)."""
    chosen = _turns_chosen_per_message(messages, scope)
    messages = [
        {k: v for k, v in m.items() if k != "loss"} for m in _text_messages(messages, images)
    ]
    text = _render(tokenizer, messages, False, tools)
    check_tools_rendered(tokenizer, messages, tools, text)
    if scope == "all":
        return text, [(0, len(text))]
    if end_of_turn is None:
        end_of_turn = end_of_turn_token(tokenizer)
    spans = []
    last_answer = max(k for k, m in enumerate(messages) if m["role"] == "assistant")
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if not chosen.get(k, scope == "assistant" or k == last_answer):
            continue
        prompt = _render(tokenizer, messages[:k], True, tools)
        upto = _render(tokenizer, messages[: k + 1], False, tools)
        if not (upto.startswith(prompt) and text.startswith(upto)):
            raise DataError(
                "the chat template re-renders earlier turns differently, so assistant spans "
                "cannot be located; use --loss_scope last_turn or a template without that rewrite"
            )
        spans.append((len(prompt), _trim_span_end(upto, len(prompt), len(upto), end_of_turn)))
    return text, spans


def _turns_chosen_per_message(messages: list[dict], scope: str) -> dict[int, bool]:
    """Message index -> trained, for the assistant turns whose row sets `loss` (ms-swift's
    per-message override of --loss_scope). --loss_scope all trains every token, which a
    per-turn choice would contradict: that is an error, not a silent pick."""
    chosen = {k: m["loss"] for k, m in enumerate(messages) if "loss" in m}
    if chosen and scope == "all":
        first = min(chosen) + 1
        raise DataError(
            f"message {first} sets 'loss', which chooses the assistant turns that train, but "
            "--loss_scope all trains every token; use --loss_scope assistant (or last_turn), "
            "or remove the 'loss' keys"
        )
    return chosen


def span_labels(ids: list[int], offsets: list, spans: list[tuple[int, int]]) -> list[int]:
    """A token's own id where it lies inside a loss span, IGNORE_INDEX elsewhere."""
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    start, end = bounds[:, 0], bounds[:, 1]
    inside = np.zeros(len(ids), dtype=bool)
    for s, e in spans:
        inside |= (s <= start) & (end <= e) & (end > start)
    return np.where(inside, np.asarray(ids, dtype=np.int64), IGNORE_INDEX).tolist()


def encode_chat(
    tokenizer, messages: list[dict], scope: str = "assistant", tools: list | None = None
) -> dict:
    """Token ids and labels (IGNORE_INDEX outside loss spans) for one conversation."""
    text, spans = assistant_char_spans(tokenizer, messages, scope, tools=tools)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    return {"input_ids": ids, "labels": span_labels(ids, encoded["offset_mapping"], spans)}


# Conversations tokenized per call: the fast tokenizer encodes a batch on all cores.
TOKENIZE_BATCH = 1024


def _encode_chat_batch(tokenizer, samples: list[dict], scope: str, end_of_turn: str) -> list:
    rendered = []
    for sample in samples:
        try:
            spans = assistant_char_spans(
                tokenizer, sample["messages"], scope, end_of_turn, sample.get("tools")
            )
            rendered.append(spans)
        except DataError as exc:
            raise DataError(f"{sample.get('source', 'sample')}: {exc}") from None
    encoded = tokenizer(
        [text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True
    )
    return [
        {"input_ids": list(ids), "labels": span_labels(ids, offsets, spans)}
        for ids, offsets, (_, spans) in zip(
            encoded["input_ids"], encoded["offset_mapping"], rendered, strict=True
        )
    ]


def has_label_tokens(labels: list[int]) -> bool:
    """Whether some label is predicted from a previous token (the first token never is)."""
    return any(label != IGNORE_INDEX for label in labels[1:])


def truncate(sample: dict, max_length: int, strategy: str, report: TruncationReport) -> dict | None:
    """Apply --truncation_strategy; None means the sample is dropped.

    Whatever the strategy, a sample left without label tokens is dropped and counted: it
    would add a step's worth of compute and nothing to learn.
    """
    ids, labels = sample["input_ids"], sample["labels"]
    cut = len(ids) > max_length
    if cut and strategy == "delete":
        report.counts["deleted"] += 1
        return None
    if cut:
        keep = slice(-max_length, None) if strategy == "left" else slice(0, max_length)
        ids, labels = ids[keep], labels[keep]
    if not has_label_tokens(labels):
        report.counts["dropped (no label tokens left)" if cut else "dropped (no label tokens)"] += 1
        return None
    if not cut:
        return sample
    report.counts["truncated"] += 1
    return {"input_ids": ids, "labels": labels}


def encode_chat_samples(
    tokenizer, samples: list[dict], max_length: int, strategy: str, scope: str
) -> tuple[list[dict], TruncationReport]:
    """Encode chat samples; over-long ones follow `strategy` and are counted, and samples
    without label tokens are dropped and counted. No sample left is a DataError."""
    encoder = ChatChunkEncoder(tokenizer, max_length, strategy, scope)
    report = encoder.new_report()
    encoded = encoder.encode(samples, report)
    if not encoded:
        raise encoder.nothing_left(len(samples), report)
    return encoded, report


@dataclass
class ChatChunkEncoder:
    """encode_chat_samples in pieces: `encode` one chunk of samples at a time into a shared
    TruncationReport, then `nothing_left` words the error when no chunk kept a sample. It
    pickles (the tokenizer with it), so worker processes can encode chunks too."""

    tokenizer: object
    max_length: int
    strategy: str
    scope: str

    def new_report(self) -> TruncationReport:
        return TruncationReport(self.strategy, self.max_length)

    def encode(self, samples: list[dict], report: TruncationReport) -> list[dict]:
        """The kept encodings of `samples`, in order; what was cut or dropped goes to `report`."""
        end_of_turn = end_of_turn_token(self.tokenizer)
        encoded = []
        for start in range(0, len(samples), TOKENIZE_BATCH):
            batch = samples[start : start + TOKENIZE_BATCH]
            for item in _encode_chat_batch(self.tokenizer, batch, self.scope, end_of_turn):
                item = truncate(item, self.max_length, self.strategy, report)
                if item is not None:
                    encoded.append(item)
        return encoded

    def nothing_left(self, total: int, report: TruncationReport) -> DataError:
        """The error for `total` samples of which no encoding was kept."""
        return DataError(
            f"no sample has label tokens to train on with --max_length {self.max_length}, "
            f"--truncation_strategy {self.strategy} and --loss_scope {self.scope} (of {total} "
            f"samples: {report}); raise --max_length, use --truncation_strategy left (it keeps "
            "the end of each conversation, where the last answer is) or --loss_scope all "
            "(loss on every token, prompts included)"
        )


def encode_pretraining(tokenizer, texts: list[str], max_length: int) -> tuple[list[dict], int]:
    """Concatenate documents with an end-of-text separator and cut into max_length chunks.

    Every token carries loss. The last chunk may be shorter than max_length; a chunk of one
    token has nothing to predict and is dropped. Returns (chunks, number dropped).
    """
    separator = tokenizer.eos_token_id
    if separator is None:
        raise DataError("the tokenizer has no EOS token to separate documents for pre-training")
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        stream.append(separator)
    chunks = [stream[i : i + max_length] for i in range(0, len(stream), max_length)]
    kept = [{"input_ids": c, "labels": list(c)} for c in chunks if has_label_tokens(c)]
    if not kept:
        raise DataError(
            f"no pre-training chunk has a token to predict with --max_length {max_length}; "
            "raise --max_length to 2 or more"
        )
    return kept, len(chunks) - len(kept)
