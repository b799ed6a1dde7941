"""Detect a row's dataset format and normalize it to canonical chat messages or plain text.

Canonical messages are `[{"role": "system"|"user"|"assistant"|"tool", "content": ...}, ...]`
where content is a string, or a list of canonical content parts when the row gave a list
(see `data.parts`). An assistant message may carry `tool_calls` and a tool message a
`tool_call_id` (see `data.tools`); other per-message keys (e.g. `name`, `loss`) are dropped.
Accepted row formats, tried in this order:

- messages: `{"messages": [{"role": ..., "content": ...}, ...], "system"?: ...}` (OpenAI /
  ms-swift style, tool calls and ms-swift's `tool_call`/`tool_response` roles included)
- ShareGPT: `{"conversations": [{"from": "human", "value": ...}, ...], "system"?: ...}`
- Alpaca: `{"instruction": ..., "input"?: ..., "output": ..., "system"?: ..., "history"?: ...}`
- query/response: `{"query": ..., "response": ..., "history"?: [[q, r], ...], "system"?: ...}`

A row that fills the columns of two of them (`messages` and `instruction`, say) is refused:
either reading would drop the other. Any of them may add a `tools` list. A field whose value is None counts as absent (parquet
and hub datasets fill missing columns with None). Problems raise `RowError`, whose `kind` is
a short category for counting.

`chat_sample` and `text_sample` are the row schemas training methods build on; they refuse
columns that only another method could use (`data.columns`).
"""

from __future__ import annotations

from typing import Any

from swiftlm.data.columns import (
    TOOLS_FOR_SFT,
    given,
    refuse_media_parts,
    refuse_other_method_columns,
)
from swiftlm.data.parts import content_images, content_text, parse_part
from swiftlm.data.row_formats import registered_format
from swiftlm.data.rows import RowError, message_loss, type_name
from swiftlm.data.tools import (
    CALL_ROLES,
    calls_from_content,
    merge_tool_calls,
    parse_tool_calls,
    parse_tools,
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

ACCEPTED_FORMATS = (
    "'messages' (role/content list), 'conversations' (ShareGPT), "
    "'instruction' + 'output' (Alpaca), 'query' + 'response'"
)

# The columns each chat format reads (loading reports a row's other columns as not used).
# `images` is read only with a vision-language model (a text model refuses the column).
FORMAT_COLUMNS = {
    "messages": ("messages", "system", "tools", "images"),
    "conversations": ("conversations", "system", "tools", "images"),
    "alpaca": ("instruction", "input", "output", "system", "history", "tools", "images"),
    "query": ("query", "response", "history", "system", "tools", "images"),
}

# Which roles may follow a given role; None is the start of the conversation.
ALLOWED_NEXT = {
    None: ("user",),
    "system": ("user",),
    "user": ("assistant",),
    "assistant": ("user", "tool"),
    "tool": ("assistant", "tool"),
}


def chat_sample(
    record: dict,
    *,
    require_answer: bool = True,
    system: str | None = None,
    placeholders: dict[str, str] | None = None,
    method: str = "sft",
    row_format: str | None = None,
) -> dict:
    """The chat row schema: one row -> `{"messages": [...], "tools"?: [...]}`, validated.

    `system` is inserted first in a conversation without a system message; each
    `placeholders` key (e.g. "{{NAME}}") is replaced by its value in all text content,
    text parts included. Both apply after validation, so a placeholder that empties a
    message does not make the row invalid. Columns for other methods are refused with a
    RowError that names `method`, the command reading the row. Image parts are kept: a
    text-only method refuses them with columns.refuse_media_parts. A row in a plugin's
    format (`row_format`, or detected) is converted first (see registered_format).
    """
    record = registered_format(record, row_format, _in_builtin_format)
    refuse_other_method_columns(record, method)
    messages = to_messages(record, require_answer=require_answer)
    tools = parse_tools(record.get("tools"))
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    if placeholders:
        messages = [
            {**message, "content": _fill(message["content"], placeholders)} for message in messages
        ]
    return {"messages": messages, "tools": tools} if tools else {"messages": messages}


def text_sample(record: dict, row_format: str | None = None) -> dict:
    """The pre-training row schema: one row -> `{"text": str}` (see to_text; raises RowError).

    Placeholders are not applied: code corpora may contain "{{...}}" as written.
    """
    record = registered_format(record, row_format, _in_builtin_format)
    refuse_other_method_columns(record, "pt", also={"tools": TOOLS_FOR_SFT})
    return {"text": to_text(record)}


def columns_read(record: dict, sample: dict) -> set[str] | None:
    """The columns of `record` that `sample` (from chat_sample or text_sample) was made of;
    None for a sample of another schema, whose columns only its method knows."""
    if "text" in sample and record.get("text") is not None:
        return {"text"}
    chat_format = _chat_format(record, require_answer=False)
    if chat_format and ("messages" in sample or "text" in sample):
        return set(FORMAT_COLUMNS[chat_format])
    return None


def to_messages(record: dict, *, require_answer: bool = True) -> list[dict]:
    """Normalize one row of any accepted chat format to checked canonical messages.

    ms-swift's one-message-per-call `tool_call` messages are merged into the assistant turn
    before them (see tools.merge_tool_calls). Raises RowError.
    """
    messages = _convert(record, require_answer)
    check_conversation(messages, require_answer=require_answer)
    return merge_tool_calls(messages)


def to_text(record: dict) -> str:
    """Return the pre-training text of one row.

    Uses the `text` field; a row without one but in a chat format is accepted too, its
    message texts joined with blank lines ("\\n\\n"), in order and without role names.
    Images and tool calls are not text: a chat row holding them is refused.
    """
    text = record.get("text")
    if given(text):
        refuse_two_layouts(["'text'", *layouts_of(record)], reader="pt")
    if text is None:
        if not _has_chat_format(record):
            keys = sorted(record)
            raise RowError(
                "no recognizable format",
                f"no recognizable format: found keys {keys}; expected 'text' or a chat "
                f"format: {ACCEPTED_FORMATS}",
            )
        messages = _convert(record)
        refuse_media_parts(messages, "pt")
        _refuse_tool_calls(messages)
        texts = (content_text(message["content"]) for message in messages)
        text = "\n\n".join(part for part in texts if part.strip())
    if not isinstance(text, str):
        raise RowError("bad field type", f"'text' must be a string, got {type_name(text)}")
    if not text.strip():
        raise RowError("empty text", "empty text")
    return text


def _refuse_tool_calls(messages: list[dict]) -> None:
    for index, message in enumerate(messages, start=1):
        if message.get("tool_calls"):
            raise RowError(
                "tool calls",
                f"message {index} is a tool call; pt trains on plain text: train tool calls "
                "with swiftlm sft, or give the row a 'text' column",
            )


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
        calls_only = bool(message.get("tool_calls")) and not content_text(content).strip()
        # ms-swift writes each call as its own message after the assistant's text.
        if not (previous == role == "assistant" and calls_only):
            _check_order(previous, role, index)
        if not calls_only:
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


# The column that puts a row in each chat format, and how messages name the format.
LAYOUT_COLUMNS = {
    "messages": ("messages", "'messages' (role/content list)"),
    "conversations": ("conversations", "'conversations' (ShareGPT)"),
    "alpaca": ("instruction", "'instruction' + 'output' (Alpaca)"),
    "query": ("query", "'query' + 'response'"),
}


def layouts_of(record: dict) -> list[str]:
    """How a message names each chat format whose column the row fills."""
    return [name for column, name in LAYOUT_COLUMNS.values() if given(record.get(column))]


def refuse_two_layouts(layouts: list[str], reader: str = "swiftlm") -> None:
    """A row in two layouts at once could be read either way: say so rather than pick one."""
    if len(layouts) > 1:
        raise RowError(
            "two layouts",
            f"the row is in {_count(layouts)} layouts at once: {' and '.join(layouts)}; {reader} "
            "would read one and drop the other: keep one layout per row (remove the other "
            "columns)",
        )


def _count(items: list) -> str:
    return {2: "two", 3: "three"}.get(len(items), str(len(items)))


def _chat_format(record: dict, require_answer: bool = True) -> str | None:
    """The chat format of a row (a FORMAT_COLUMNS key), None when it has none; a row in two
    is refused.

    Inference prompts (`require_answer=False`) may omit the answer field (`output` or
    `response`).
    """
    refuse_two_layouts(layouts_of(record))
    if record.get("messages") is not None:
        return "messages"
    if record.get("conversations") is not None:
        return "conversations"
    if _present(record, "instruction") and (_present(record, "output") or not require_answer):
        return "alpaca"
    if _present(record, "query") and (_present(record, "response") or not require_answer):
        return "query"
    return None


def _in_builtin_format(record: dict) -> bool:
    return record.get("text") is not None or _chat_format(record, False) is not None


def _has_chat_format(record: dict) -> bool:
    return _chat_format(record) is not None


def _convert(record: dict, require_answer: bool = True) -> list[dict]:
    """Convert a row of any chat format to (unchecked) canonical messages; an inference
    prompt without an answer ends with the user turn."""
    chat_format = _chat_format(record, require_answer)
    if chat_format == "messages":
        return _with_system(record, _from_role_list(record["messages"], "messages"))
    if chat_format == "conversations":
        return _with_system(record, _from_sharegpt(record["conversations"]))
    if chat_format == "alpaca":
        prompt = _string(record, "instruction")
        extra = _string(record, "input", required=False)
        if extra.strip():
            prompt = f"{prompt}\n{extra}"
        return _with_system(record, _history(record) + _turn(prompt, _answer(record, "output")))
    if chat_format == "query":
        turn = _turn(_string(record, "query"), _answer(record, "response"))
        return _with_system(record, _history(record) + turn)
    raise RowError(
        "no recognizable format",
        f"no recognizable format: found keys {sorted(record)}; expected {ACCEPTED_FORMATS}",
    )


def _from_sharegpt(turns: Any) -> list[dict]:
    # Some ShareGPT exports use role/content keys inside `conversations`.
    if isinstance(turns, list) and turns and isinstance(turns[0], dict) and "from" not in turns[0]:
        return _from_role_list(turns, "conversations", "role", "content")
    return _from_role_list(turns, "conversations", "from", "value")


def _from_role_list(
    turns: Any, field: str, role_key: str = "role", content_key: str = "content"
) -> list[dict]:
    """Convert a list of {role_key, content_key} turns, mapping role names of that format."""
    aliases, expected = (
        (MESSAGE_ROLE_ALIASES, MESSAGE_ROLES)
        if field == "messages"
        else (SHAREGPT_ROLES, SHAREGPT_ROLE_NAMES)
    )
    if not isinstance(turns, list):
        raise RowError("bad field type", f"{field!r} must be a list, got {type_name(turns)}")
    messages = []
    for index, turn in enumerate(turns, start=1):
        role, content = _message_fields(turn, index, role_key, content_key)
        if role not in aliases:
            raise RowError(
                "unknown role", f"unknown role {role!r} in message {index}; expected {expected}"
            )
        messages.append(_message(turn, role, aliases[role], content, index))
    return messages


def _message(turn: dict, role: str, canonical: str, content: Any, index: int) -> dict:
    """One canonical message, with its tool calls (OpenAI `tool_calls`, or a call role whose
    content is the call) and a tool result's `tool_call_id`."""
    where = f"message {index} ({role})"
    if role in CALL_ROLES:
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": calls_from_content(content, where),
        }
    message = {"role": canonical, "content": content}
    if turn.get("tool_calls"):  # exports write an empty list on messages without calls
        if canonical != "assistant":
            raise RowError(
                "bad tool call", f"{where} has 'tool_calls'; only assistant messages call tools"
            )
        message["tool_calls"] = parse_tool_calls(turn["tool_calls"], where)
    if canonical == "tool" and isinstance(turn.get("tool_call_id"), str):
        message["tool_call_id"] = turn["tool_call_id"]
    if turn.get("loss") is not None:
        message["loss"] = message_loss(turn["loss"], canonical, where)
    return message


def _message_fields(
    turn: Any, index: int, role_key: str, content_key: str
) -> tuple[str, str | list[dict]]:
    if not isinstance(turn, dict):
        raise RowError(
            "bad field type",
            f"message {index} is {type_name(turn)}; expected an object with "
            f"{role_key!r} and {content_key!r}",
        )
    role, content = turn.get(role_key), turn.get(content_key)
    if not isinstance(role, str):
        raise RowError(
            "bad field type", f"message {index} has no string {role_key!r} (got {type_name(role)})"
        )
    where = f"message {index} ({role})"
    if role in CALL_ROLES:  # the call itself, read by tools.calls_from_content
        return role, content
    if isinstance(content, list):
        parts = enumerate(content, start=1)
        return role, [parse_part(part, f"{where} content part {n}") for n, part in parts]
    if content is None and turn.get("tool_calls"):
        return role, ""  # OpenAI writes null content beside the calls
    if not isinstance(content, str):
        # A null is most often a missing answer: name the plain fix first.
        expected = "a string" if content is None else "a string or a list of content parts"
        raise RowError(
            "bad field type",
            f"{where} {content_key!r} must be {expected}, got {type_name(content)}",
        )
    return role, content


def _history(record: dict) -> list[dict]:
    history = record.get("history")
    if history is None:
        return []
    if not isinstance(history, list):
        raise RowError(
            "bad field type",
            f"'history' must be a list of [query, response] pairs, got {type_name(history)}",
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
    if messages and messages[0]["role"] == "system":
        raise RowError(
            "conflicting system",
            "the row has both a 'system' column and a system message (message 1); keep one",
        )
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
        raise RowError("bad field type", f"{key!r} must be a string, got {type_name(value)}")
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
