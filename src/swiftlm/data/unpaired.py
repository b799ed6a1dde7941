"""The unpaired row schema of `swiftlm rlhf --rlhf_type kto`: one row -> one or two answers,
each labelled desirable (true) or undesirable (false).

Three layouts are read:
- `messages` (a conversation whose last turn is the assistant's answer) + `label`;
- TRL's unpaired layout: `prompt` (a string or a message list) + `completion` (a string or a
  message list) + `label`;
- a preference pair in any layout of data/preference.py (no `label`): it becomes one desirable
  sample (the chosen answer) and one undesirable sample (the rejected answer), as TRL's
  `unpair_preference_dataset` does.
`label` must be a JSON boolean: `1`, `"yes"` or `"true"` are refused, so a column of scores
is not silently read as labels.
"""

from typing import Any

from swiftlm.data.columns import given, refuse_media_parts
from swiftlm.data.formats import to_messages
from swiftlm.data.preference import preference_sample
from swiftlm.data.rows import RowError, type_name

LAYOUTS = (
    "`messages` + `label`, `prompt` + `completion` + `label` (TRL), or a preference pair "
    "(`messages` + `rejected_response`, or `chosen` + `rejected`)"
)


def unpaired_samples(record: dict, *, method: str, system: str | None = None) -> dict:
    """`{"answers": [{"messages": [...], "desirable": bool}, ...]}` (one answer, or two for a
    preference pair), each conversation ending with its answer; RowError."""
    if given(record.get("label")) or given(record.get("completion")):
        answers = [_labelled(record, method)]
    elif _paired(record):
        pair = preference_sample(record, method=method, system=system)
        return {
            "answers": [
                {"messages": pair["chosen"], "desirable": True},
                {"messages": pair["rejected"], "desirable": False},
            ]
        }
    else:
        raise RowError(
            "no recognizable format",
            f"no labelled answer: {method} reads {LAYOUTS}; found columns {sorted(record)}",
        )
    for answer in answers:
        refuse_media_parts(answer["messages"], method)
        if system and answer["messages"][0]["role"] != "system":
            answer["messages"].insert(0, {"role": "system", "content": system})
    return {"answers": answers}


def _paired(record: dict) -> bool:
    return any(given(record.get(k)) for k in ("rejected_response", "rejected_messages", "rejected"))


def _labelled(record: dict, method: str) -> dict:
    label = record.get("label")
    if not isinstance(label, bool):
        raise RowError(
            "bad field type",
            f"`label` must be true (a desirable answer) or false (an undesirable one), got "
            f"{type_name(label)} {label!r}: {method} reads JSON booleans only",
        )
    if given(record.get("completion")):
        messages = _prompt_completion(record)
    else:
        conversation = {k: v for k, v in record.items() if k != "label"}
        messages = to_messages(conversation)
    return {"messages": messages, "desirable": label}


def _prompt_completion(record: dict) -> list[dict]:
    prompt, completion = record.get("prompt"), record["completion"]
    if not given(prompt):
        raise RowError("no answer", "`completion` is given without its `prompt`: add the column")
    prompt = _as_messages(prompt, "prompt", "user")
    completion = _as_messages(completion, "completion", "assistant")
    return to_messages({"messages": [*prompt, *completion]})


def _as_messages(value: Any, name: str, role: str) -> list:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list):
        raise RowError(
            "bad field type",
            f"`{name}` must be a string or a message list, got {type_name(value)}",
        )
    return value
