"""The preference row schema of `swiftlm rlhf` (DPO): one row -> a chosen and a rejected
conversation that share their prompt.

Two layouts are read, the ones hub preference datasets use:
- ms-swift: `messages` whose last assistant message is the chosen answer, plus
  `rejected_response` (the rejected answer's text) or `rejected_messages` (the whole rejected
  conversation);
- TRL: `chosen` and `rejected`, each a string (an answer) or a message list, with a `prompt`
  (a string or a message list); without `prompt`, `chosen` and `rejected` are whole
  conversations (TRL's "implicit prompt").
Both conversations are checked like SFT conversations (roles, order, an assistant answer
last). A row whose two answers are identical is refused: it carries no preference.
"""

from typing import Any

from swiftlm.data.columns import given, refuse_media_parts
from swiftlm.data.formats import to_messages
from swiftlm.data.rows import RowError, type_name

LAYOUTS = (
    "`messages` + `rejected_response` or `rejected_messages` (ms-swift), or "
    "`chosen` + `rejected` with an optional `prompt` (TRL)"
)


def preference_sample(
    record: dict, *, method: str, system: str | None = None, images: bool = False
) -> dict:
    """`{"chosen": messages, "rejected": messages}`, both ending with the answer; RowError.

    Image parts are refused unless `images` (a vision-language model, data.vision_rows)."""
    _refuse_both_layouts(record)
    if given(record.get("rejected_response")) or given(record.get("rejected_messages")):
        chosen, rejected = _ms_swift(record)
    elif given(record.get("chosen")) and given(record.get("rejected")):
        chosen, rejected = _trl(record)
    else:
        raise RowError(
            "no recognizable format",
            f"no preference pair: {method} reads {LAYOUTS}; found columns {sorted(record)}",
        )
    if chosen[-1]["content"] == rejected[-1]["content"]:
        raise RowError(
            "no recognizable format",
            "the chosen and the rejected answers are identical: the row states no preference",
        )
    for messages in (chosen, rejected):
        if not images:
            refuse_media_parts(messages, method)
        if system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
    return {"chosen": chosen, "rejected": rejected}


def _refuse_both_layouts(record: dict) -> None:
    """ms-swift's columns beside TRL's: either reading would drop the other pair."""
    ms_swift = [
        c for c in ("messages", "rejected_response", "rejected_messages") if given(record.get(c))
    ]
    trl = [c for c in ("chosen", "rejected") if given(record.get(c))]
    if ms_swift and trl:
        raise RowError(
            "two layouts",
            f"the row is in both preference layouts: ms-swift ({' + '.join(ms_swift)}) and TRL "
            f"({' + '.join(trl)}); swiftlm would read one pair and drop the other: keep one "
            "layout per row",
        )


def _ms_swift(record: dict) -> tuple[list[dict], list[dict]]:
    conversation = {k: v for k, v in record.items() if not k.startswith("rejected_")}
    chosen = to_messages(conversation)
    if given(record.get("rejected_response")) and given(record.get("rejected_messages")):
        raise RowError(
            "no recognizable format",
            "both `rejected_response` and `rejected_messages` are given: keep one",
        )
    if given(record.get("rejected_messages")):
        return chosen, to_messages({"messages": record["rejected_messages"]})
    answer = record["rejected_response"]
    if not isinstance(answer, str):
        raise RowError(
            "bad field type", f"`rejected_response` must be a string, got {type_name(answer)}"
        )
    return chosen, to_messages({"messages": [*chosen[:-1], _assistant(answer)]})


def _trl(record: dict) -> tuple[list[dict], list[dict]]:
    prompt = record.get("prompt")
    if not given(prompt):  # implicit prompt: two whole conversations
        if isinstance(record["chosen"], str) or isinstance(record["rejected"], str):
            raise RowError(
                "no answer",
                "`chosen`/`rejected` are answer strings but the row has no `prompt`: add the "
                "prompt column, or give both as whole conversations (message lists)",
            )
        return _conversation(record["chosen"], "chosen"), _conversation(
            record["rejected"], "rejected"
        )
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    elif not isinstance(prompt, list):
        raise RowError(
            "bad field type",
            f"`prompt` must be a string or a message list, got {type_name(prompt)}",
        )
    sides = []
    for name in ("chosen", "rejected"):
        answer = record[name]
        answer = [_assistant(answer)] if isinstance(answer, str) else answer
        sides.append(_conversation([*prompt, *_message_list(answer, name)], name))
    return sides[0], sides[1]


def _conversation(value: Any, name: str) -> list[dict]:
    return to_messages({"messages": _message_list(value, name)})


def _message_list(value: Any, name: str) -> list:
    if not isinstance(value, list):
        raise RowError(
            "bad field type",
            f"`{name}` must be a string or a message list, got {type_name(value)}",
        )
    return value


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}
