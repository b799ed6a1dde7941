"""Prompt rows of the online methods (GRPO, GKD): a conversation to continue, plus any other
columns, which GRPO passes to the reward functions (e.g. `solution` for `accuracy`).

Accepted layouts:
- ms-swift: `messages` ending with a user turn; a final assistant turn is the reference answer:
  it is not part of the prompt and is kept as the `response` column (GKD trains on it);
- TRL: `prompt`, a string or a message list, with an optional `completion` (the reference);
- `query` (+ optional `response`) and Alpaca's `instruction`/`input` (+ `output`).
"""

import json
from typing import Any

from swiftlm.data.columns import (
    OTHER_METHOD_COLUMNS,
    given,
    refuse_media_parts,
    refuse_other_method_columns,
)
from swiftlm.data.formats import to_messages
from swiftlm.data.rows import RowError, type_name

PROMPT_LAYOUTS = (
    "`messages` (ms-swift), `prompt` (TRL: a string or a message list), `query` or "
    "`instruction`/`input`"
)
# The columns a layout is made of; the others go to the reward functions.
_LAYOUT_COLUMNS = ("messages", "prompt", "completion", "query", "response", "system")
_ALPACA_COLUMNS = ("instruction", "input", "output")
_MEDIA_COLUMNS = [column for column, (_, kind) in OTHER_METHOD_COLUMNS.items() if kind == "media"]


def prompt_sample(record: dict, *, method: str, system: str | None = None) -> dict:
    """`{"prompt": messages ending with a user turn, "response": reference answer or None,
    "columns": the row's other columns (JSON-serializable)}`; RowError for a bad row."""
    refuse_other_method_columns({c: record.get(c) for c in _MEDIA_COLUMNS}, method)
    prompt, response = _prompt_and_response(record, method)
    refuse_media_parts(prompt, method)
    if system and prompt[0]["role"] != "system":
        prompt.insert(0, {"role": "system", "content": system})
    used = _LAYOUT_COLUMNS + (_ALPACA_COLUMNS if given(record.get("instruction")) else ())
    columns = {k: v for k, v in record.items() if k not in used}
    try:
        json.dumps(columns)
    except (TypeError, ValueError) as exc:
        raise RowError("bad field type", f"a column is not JSON-serializable: {exc}") from None
    return {"prompt": prompt, "response": response, "columns": columns}


def _prompt_and_response(record: dict, method: str) -> tuple[list[dict], str | None]:
    if given(record.get("messages")):
        messages = to_messages({"messages": record["messages"]}, require_answer=False)
        if messages[-1]["role"] == "assistant":
            return _ending_with_user(messages[:-1]), _text(messages[-1]["content"])
        return _ending_with_user(messages), None
    if given(record.get("prompt")):
        value = record["prompt"]
        if isinstance(value, str):
            messages = [{"role": "user", "content": value}]
        elif isinstance(value, list):
            messages = to_messages({"messages": value}, require_answer=False)
        else:
            raise RowError(
                "bad field type",
                f"`prompt` must be a string or a message list, got {type_name(value)}",
            )
        return _ending_with_user(messages), _optional_text(record, "completion")
    if given(record.get("query")):
        return [_user(record, "query")], _optional_text(record, "response")
    if given(record.get("instruction")):
        text = record["instruction"]
        if given(record.get("input")):
            text = f"{text}\n{record['input']}"
        return [{"role": "user", "content": str(text)}], _optional_text(record, "output")
    raise RowError(
        "no recognizable format",
        f"no prompt: {method} reads {PROMPT_LAYOUTS}; found columns {sorted(record)}",
    )


def _ending_with_user(messages: list[dict]) -> list[dict]:
    if not messages or messages[-1]["role"] != "user":
        last = messages[-1]["role"] if messages else "nothing"
        raise RowError(
            "no recognizable format",
            f"the prompt must end with a user turn (the model answers it), it ends with {last}",
        )
    return messages


def _user(record: dict, key: str) -> dict:
    value = record[key]
    if not isinstance(value, str):
        raise RowError("bad field type", f"`{key}` must be a string, got {type_name(value)}")
    return {"role": "user", "content": value}


def _optional_text(record: dict, key: str) -> str | None:
    value = record.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RowError("bad field type", f"`{key}` must be a string, got {type_name(value)}")
    return value


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))
