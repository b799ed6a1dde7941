"""Detect a row's dataset format and normalize it to canonical chat messages or plain text.

Canonical messages are `[{"role": "system"|"user"|"assistant"|"tool", "content": ...}, ...]`
where content is a string, or a list of canonical content parts when the row gave a list:
`{"type": "text", "text": str}` and `{"type": "image", "image": str}` (a path or URL). Rows
may write parts OpenAI-style (`{"type": "image_url", "image_url": {"url": ...}}`, or
`"image_url": "..."`) or ms-swift-style (`{"type": "image", "image": ...}`).
Accepted row formats, tried in this order:

- messages: `{"messages": [{"role": ..., "content": ...}, ...]}` (OpenAI / ms-swift style)
- ShareGPT: `{"conversations": [{"from": "human", "value": ...}, ...], "system"?: ...}`
- Alpaca: `{"instruction": ..., "input"?: ..., "output": ..., "system"?: ..., "history"?: ...}`
- query/response: `{"query": ..., "response": ..., "history"?: [[q, r], ...], "system"?: ...}`

A field whose value is None counts as absent (parquet and hub datasets fill missing
columns with None). Problems raise `RowError`, whose `kind` is a short category for counting.

`chat_sample` and `text_sample` are the row schemas training methods build on.
"""

from __future__ import annotations

from typing import Any

ROW_ERROR_KINDS = (
    "invalid JSON",
    "invalid CSV",
    "not an object",
    "no recognizable format",
    "unknown role",
    "empty content",
    "empty assistant answer",
    "wrong role order",
    "no answer",
    "empty text",
    "bad field type",
    "bad content part",
)

ROLES = ("system", "user", "assistant", "tool")

# ms-swift spellings of tool messages in the `messages` format.
MESSAGE_ROLE_ALIASES = {
    **{role: role for role in ROLES},
    "function": "tool",
    "tool_response": "tool",
    "tool_call": "assistant",
}

MESSAGE_ROLES = "system, user, assistant or tool"

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}

SHAREGPT_ROLE_NAMES = "human, gpt, system, tool, function or observation"

PART_TYPES = "'text', 'image_url' or 'image'"
PART_EXAMPLES = {
    "text": '{"type": "text", "text": "..."}',
    "image_url": '{"type": "image_url", "image_url": {"url": "cat.png"}}',
    "image": '{"type": "image", "image": "cat.png"}',
}

ACCEPTED_FORMATS = (
    "'messages' (role/content list), 'conversations' (ShareGPT), "
    "'instruction' + 'output' (Alpaca), 'query' + 'response'"
)

# Which roles may follow a given role; None is the start of the conversation.
ALLOWED_NEXT = {
    None: ("user",),
    "system": ("user",),
    "user": ("assistant",),
    "assistant": ("user", "tool"),
    "tool": ("assistant", "tool"),
}


class RowError(ValueError):
    """One dataset row that cannot be used; `kind` is one of ROW_ERROR_KINDS."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def chat_sample(
    record: dict,
    *,
    require_answer: bool = True,
    system: str | None = None,
    placeholders: dict[str, str] | None = None,
) -> dict:
    """The chat row schema: one row -> `{"messages": [...]}`, validated (raises RowError).

    `system` is inserted first in a conversation without a system message; each
    `placeholders` key (e.g. "{{NAME}}") is replaced by its value in all text content,
    text parts included. Both apply after validation, so a placeholder that empties a
    message does not make the row invalid.
    """
    messages = to_messages(record, require_answer=require_answer)
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    if placeholders:
        messages = [
            {**message, "content": _fill(message["content"], placeholders)} for message in messages
        ]
    return {"messages": messages}


def text_sample(record: dict) -> dict:
    """The pre-training row schema: one row -> `{"text": str}` (see to_text; raises RowError).

    Placeholders are not applied: code corpora may contain "{{...}}" as written.
    """
    return {"text": to_text(record)}


def content_text(content: str | list[dict]) -> str:
    """The text of canonical content: a string as is, text parts joined with no separator
    (what chat templates that iterate over parts render)."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part["type"] == "text")


def content_images(content: str | list[dict]) -> list[str]:
    """The image references (paths or URLs) of canonical content, in order."""
    if isinstance(content, str):
        return []
    return [part["image"] for part in content if part["type"] == "image"]


def flatten_text_parts(messages: list[dict]) -> list[dict]:
    """Copy of canonical messages with every text-only part list replaced by its string.

    Templates written for string content then render such a message exactly like the
    equivalent string; contents with images keep their parts.
    """
    return [
        message
        if isinstance(message["content"], str) or content_images(message["content"])
        else {**message, "content": content_text(message["content"])}
        for message in messages
    ]


def to_messages(record: dict, *, require_answer: bool = True) -> list[dict]:
    """Normalize one row of any accepted chat format to checked canonical messages.

    Extra per-message keys (e.g. `name`, `loss`) are dropped. Raises RowError.
    """
    messages = _convert(record, require_answer)
    check_conversation(messages, require_answer=require_answer)
    return messages


def to_text(record: dict) -> str:
    """Return the pre-training text of one row.

    Uses the `text` field; a row without one but in a chat format is accepted too, its
    message texts joined with blank lines ("\\n\\n"), in order and without role names
    (images are left out).
    """
    text = record.get("text")
    if text is None:
        if not _has_chat_format(record):
            keys = sorted(record)
            raise RowError(
                "no recognizable format",
                f"no recognizable format: found keys {keys}; expected 'text' or a chat "
                f"format: {ACCEPTED_FORMATS}",
            )
        texts = (content_text(message["content"]) for message in _convert(record))
        text = "\n\n".join(part for part in texts if part.strip())
    if not isinstance(text, str):
        raise RowError("bad field type", f"'text' must be a string, got {_type(text)}")
    if not text.strip():
        raise RowError("empty text", "empty text")
    return text


def check_conversation(messages: list[dict], require_answer: bool = True) -> None:
    """Check roles, role order and contents of canonical messages; raise RowError if bad.

    Training data (`require_answer=True`) must end with an assistant answer; inference
    prompts (`require_answer=False`) may end with a user or tool message.
    """
    previous = None
    for index, message in enumerate(messages, start=1):
        role, content = _message_fields(message, index, "role", "content")
        if role not in ROLES:
            raise RowError(
                "unknown role",
                f"unknown role {role!r} in message {index}; expected {MESSAGE_ROLES}",
            )
        _check_order(previous, role, index)
        _check_content(role, content, index)
        previous = role
    if previous in (None, "system"):
        raise RowError("empty content", "empty content: the conversation has no user message")
    if require_answer and previous != "assistant":
        raise RowError(
            "no answer",
            f"no answer: the conversation ends with a {previous!r} message "
            f"(message {len(messages)}); training needs an assistant answer last",
        )


def _check_order(previous: str | None, role: str, index: int) -> None:
    if role == "system":
        if index == 1:
            return
        raise RowError(
            "wrong role order",
            f"wrong role order: message {index} is 'system'; a system message is only "
            "allowed first",
        )
    allowed = ALLOWED_NEXT[previous]
    if role not in allowed:
        where = "at the start" if previous in (None, "system") else f"after {previous!r}"
        expected = " or ".join(repr(r) for r in allowed)
        raise RowError(
            "wrong role order",
            f"wrong role order: message {index} is {role!r} {where}; expected {expected}",
        )


def _check_content(role: str, content: str | list[dict], index: int) -> None:
    # An empty system prompt is harmless; an empty turn teaches or asks nothing.
    if role == "system" or content_text(content).strip() or content_images(content):
        return
    if role == "assistant":
        raise RowError("empty assistant answer", f"empty assistant answer in message {index}")
    raise RowError("empty content", f"empty content in {role} message {index}")


def _convert(record: dict, require_answer: bool = True) -> list[dict]:
    """Detect the row's format and convert it to (unchecked) canonical messages.

    Inference prompts (`require_answer=False`) may omit the answer field (`output` or
    `response`); the conversation then ends with the user turn.
    """
    if record.get("messages") is not None:
        return _from_role_list(record["messages"], "messages", "role", "content")
    if record.get("conversations") is not None:
        return _with_system(record, _from_sharegpt(record["conversations"]))
    if _present(record, "instruction") and (_present(record, "output") or not require_answer):
        prompt = _string(record, "instruction")
        extra = _string(record, "input", required=False)
        if extra.strip():
            prompt = f"{prompt}\n{extra}"
        return _with_system(record, _history(record) + _turn(prompt, _answer(record, "output")))
    if _present(record, "query") and (_present(record, "response") or not require_answer):
        turn = _turn(_string(record, "query"), _answer(record, "response"))
        return _with_system(record, _history(record) + turn)
    raise RowError(
        "no recognizable format",
        f"no recognizable format: found keys {sorted(record)}; expected {ACCEPTED_FORMATS}",
    )


def _has_chat_format(record: dict) -> bool:
    return (
        record.get("messages") is not None
        or record.get("conversations") is not None
        or _present(record, "instruction", "output")
        or _present(record, "query", "response")
    )


def _from_sharegpt(turns: Any) -> list[dict]:
    # Some ShareGPT exports use role/content keys inside `conversations`.
    if isinstance(turns, list) and turns and isinstance(turns[0], dict) and "from" not in turns[0]:
        return _from_role_list(turns, "conversations", "role", "content")
    return _from_role_list(turns, "conversations", "from", "value")


def _from_role_list(turns: Any, field: str, role_key: str, content_key: str) -> list[dict]:
    """Convert a list of {role_key, content_key} turns, mapping role names of that format."""
    aliases, expected = (
        (MESSAGE_ROLE_ALIASES, MESSAGE_ROLES)
        if field == "messages"
        else (SHAREGPT_ROLES, SHAREGPT_ROLE_NAMES)
    )
    if not isinstance(turns, list):
        raise RowError("bad field type", f"{field!r} must be a list, got {_type(turns)}")
    messages = []
    for index, turn in enumerate(turns, start=1):
        role, content = _message_fields(turn, index, role_key, content_key)
        if role not in aliases:
            raise RowError(
                "unknown role", f"unknown role {role!r} in message {index}; expected {expected}"
            )
        messages.append({"role": aliases[role], "content": content})
    return messages


def _message_fields(
    turn: Any, index: int, role_key: str, content_key: str
) -> tuple[str, str | list[dict]]:
    if not isinstance(turn, dict):
        raise RowError(
            "bad field type",
            f"message {index} is {_type(turn)}; expected an object with "
            f"{role_key!r} and {content_key!r}",
        )
    role, content = turn.get(role_key), turn.get(content_key)
    if not isinstance(role, str):
        raise RowError(
            "bad field type", f"message {index} has no string {role_key!r} (got {_type(role)})"
        )
    where = f"message {index} ({role})"
    if isinstance(content, list):
        return role, [_part(part, f"{where} content part {n}") for n, part in enumerate(content, 1)]
    if not isinstance(content, str):
        # A null is most often a missing answer: name the plain fix first.
        expected = "a string" if content is None else "a string or a list of content parts"
        raise RowError(
            "bad field type", f"{where} {content_key!r} must be {expected}, got {_type(content)}"
        )
    return role, content


def _part(part: Any, where: str) -> dict:
    """One content part -> its canonical form; raise RowError naming the part and the fix."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise RowError(
                "bad content part",
                f"{where} has no string 'text' (got {_type(text)}); write {PART_EXAMPLES['text']}",
            )
        return {"type": "text", "text": text}
    if kind in ("image_url", "image"):
        return {"type": "image", "image": _image_reference(part, kind, where)}
    if not isinstance(part, dict):
        problem = f"is {_type(part)}"
    elif kind is None:
        problem = "has no 'type'"
    else:
        problem = f"has unknown type {kind!r}"
    raise RowError(
        "bad content part",
        f"{where} {problem}; expected an object of type {PART_TYPES}, e.g. {PART_EXAMPLES['text']}",
    )


def _image_reference(part: dict, kind: str, where: str) -> str:
    value, field = part.get(kind), repr(kind)
    if kind == "image_url" and isinstance(value, dict):
        value, field = value.get("url"), "'image_url.url'"
    if not isinstance(value, str):
        raise RowError(
            "bad content part",
            f"{where} needs a string {field} (got {_type(value)}); write {PART_EXAMPLES[kind]}",
        )
    if not value.strip():
        raise RowError(
            "bad content part", f"{where} has an empty {field}; give an image path or URL"
        )
    return value


def _history(record: dict) -> list[dict]:
    history = record.get("history")
    if history is None:
        return []
    if not isinstance(history, list):
        raise RowError(
            "bad field type",
            f"'history' must be a list of [query, response] pairs, got {_type(history)}",
        )
    messages = []
    for index, pair in enumerate(history, start=1):
        is_pair = isinstance(pair, (list, tuple)) and len(pair) == 2
        if not is_pair or not all(isinstance(text, str) for text in pair):
            raise RowError(
                "bad field type",
                f"'history' item {index} must be a [query, response] pair of strings",
            )
        messages += _turn(pair[0], pair[1])
    return messages


def _with_system(record: dict, messages: list[dict]) -> list[dict]:
    system = _string(record, "system", required=False)
    if not system.strip():
        return messages
    return [{"role": "system", "content": system}, *messages]


def _turn(prompt: str, answer: str | None) -> list[dict]:
    """A user turn and its answer (none for an inference prompt without one)."""
    user = [{"role": "user", "content": prompt}]
    return user if answer is None else [*user, {"role": "assistant", "content": answer}]


def _answer(record: dict, key: str) -> str | None:
    return None if record.get(key) is None else _string(record, key)


def _string(record: dict, key: str, required: bool = True) -> str:
    value = record.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise RowError("bad field type", f"{key!r} must be a string, got {_type(value)}")
    return value


def _fill(content: str | list[dict], placeholders: dict[str, str]) -> str | list[dict]:
    """Replace each placeholder key by its value in a string or in the text parts."""
    if not isinstance(content, str):
        return [
            {**part, "text": _fill(part["text"], placeholders)} if part["type"] == "text" else part
            for part in content
        ]
    for key, value in placeholders.items():
        content = content.replace(key, value)
    return content


def _present(record: dict, *keys: str) -> bool:
    return all(record.get(key) is not None for key in keys)


def _type(value: Any) -> str:
    return "null" if value is None else type(value).__name__
