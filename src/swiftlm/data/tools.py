"""Tool-calling rows: the `tools` column and assistant tool calls, in canonical form.

Canonical form, as transformers' chat templates take it (`apply_chat_template(messages,
tools=tools)`):

- a sample's `tools`: `[{"type": "function", "function": {"name": ..., "description": ...,
  "parameters": {...}}}, ...]`
- an assistant message that calls tools: `{"role": "assistant", "content": str, "tool_calls":
  [{"type": "function", "function": {"name": str, "arguments": dict}, "id"?: str}, ...]}`
- a tool result: `{"role": "tool", "content": ..., "tool_call_id"?: str}`

Accepted inputs: OpenAI `tool_calls` (content null or text; `arguments` a JSON string or an
object); ms-swift agent rows (`tools` as a JSON string or a list; a `tool_call` message whose
content is the JSON call `{"name": ..., "arguments": ...}`, one message per call, right after
the assistant text if any); ShareGPT `function_call` turns, written like ms-swift's.
"""

from __future__ import annotations

import json
from typing import Any

from swiftlm.data.rows import RowError, type_name

TOOL_EXAMPLE = (
    '{"type": "function", "function": {"name": "get_weather", "description": "...", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}'
)
CALL_EXAMPLE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'

# Roles whose content is the JSON of a call (ms-swift's `tool_call`, ShareGPT's `function_call`).
CALL_ROLES = ("tool_call", "function_call")


def parse_tools(value: Any) -> list[dict] | None:
    """The row's `tools` column -> a list of tools, or None when the row gives none.

    A JSON string is parsed (ms-swift stores tools that way); a bare function schema
    `{"name", "description", "parameters"}` is wrapped as `{"type": "function", "function":
    schema}`, the form chat templates read. An empty list or string means no tools (a
    mixed dataset leaves the column empty on rows without tools).
    """
    if isinstance(value, str):
        if not value.strip():
            return None
        value = _loads(value, "'tools'", f"[{TOOL_EXAMPLE}]")
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise RowError(
            "bad tool call",
            f"'tools' must be a list of tools, got {type_name(value)}; write [{TOOL_EXAMPLE}]",
        )
    return [_tool(item, f"'tools' item {n}") for n, item in enumerate(value, start=1)]


def _tool(item: Any, where: str) -> dict:
    nested = isinstance(item, dict) and isinstance(item.get("function"), dict)
    function = item["function"] if nested else item
    if not (isinstance(function, dict) and _has_name(function)):
        raise RowError("bad tool call", f"{where} has no function name; write {TOOL_EXAMPLE}")
    if nested:
        return {**item, "type": item.get("type", "function")}
    return {"type": "function", "function": function}


def parse_tool_calls(value: Any, where: str) -> list[dict]:
    """An assistant message's OpenAI `tool_calls` list -> canonical calls."""
    if not isinstance(value, list) or not value:
        raise RowError(
            "bad tool call",
            f"{where} 'tool_calls' must be a non-empty list of calls, got {type_name(value)}; "
            f'write [{{"type": "function", "function": {CALL_EXAMPLE}}}]',
        )
    return [_call(item, f"{where} tool call {n}") for n, item in enumerate(value, start=1)]


def calls_from_content(content: Any, where: str) -> list[dict]:
    """The content of a `tool_call`/`function_call` message -> canonical calls.

    The content is the JSON of a call or of a list of calls, or (from parquet or hub
    datasets) the already parsed object or list.
    """
    if isinstance(content, str):
        content = _loads(content, f"{where} content", CALL_EXAMPLE)
    if not isinstance(content, (dict, list)) or not content:
        raise RowError(
            "bad tool call", f"{where} content must be the JSON of a call, e.g. {CALL_EXAMPLE}"
        )
    items = content if isinstance(content, list) else [content]
    return [_call(item, where) for item in items]


def _call(item: Any, where: str) -> dict:
    # OpenAI nests name and arguments under "function"; ms-swift writes them at the top.
    function = item.get("function") if isinstance(item, dict) and "function" in item else item
    if not (isinstance(function, dict) and _has_name(function)):
        raise RowError("bad tool call", f"{where} has no function name; write {CALL_EXAMPLE}")
    # Some datasets spell the arguments "parameters", like a tool's schema.
    arguments = function.get("arguments", function.get("parameters"))
    call = {
        "type": "function",
        "function": {"name": function["name"], "arguments": _arguments(arguments, where)},
    }
    if isinstance(item.get("id"), str):
        call["id"] = item["id"]
    return call


def _arguments(value: Any, where: str) -> dict:
    """The call's arguments as an object: chat templates write them with `tojson`, so a JSON
    string would come out quoted twice."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = _loads(value, f"{where} arguments", '{"city": "Paris"}') if value.strip() else {}
    if not isinstance(value, dict):
        raise RowError(
            "bad tool call",
            f"{where} arguments must be a JSON object, got {type_name(value)}; "
            'write e.g. {"city": "Paris"}',
        )
    return value


def merge_tool_calls(messages: list[dict]) -> list[dict]:
    """Join each assistant message with the tool-call messages right after it into one turn.

    ms-swift rows give every call its own `tool_call` message; a model writes its text and
    all its calls in one assistant turn, which is how the chat template must render them.
    check_conversation allows an assistant message right after another only when it holds
    nothing but calls, so no text is lost here.
    """
    merged: list[dict] = []
    for message in messages:
        previous = merged[-1] if merged else None
        if previous and previous["role"] == "assistant" and message.get("tool_calls"):
            calls = [*previous.get("tool_calls", []), *message["tool_calls"]]
            merged[-1] = {**previous, "tool_calls": calls}
        else:
            merged.append(message)
    return merged


def tool_call_names(message: dict) -> list[str]:
    return [call["function"]["name"] for call in message.get("tool_calls", [])]


def _has_name(function: dict) -> bool:
    name = function.get("name")
    return isinstance(name, str) and bool(name.strip())


def _loads(text: str, where: str, example: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RowError(
            "bad tool call",
            f"{where}: not valid JSON ({e.msg} at column {e.colno}); write {example}",
        ) from None
