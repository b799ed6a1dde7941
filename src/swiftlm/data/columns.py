"""Dataset columns that mean something swiftlm cannot do with the method reading them.

ms-swift's dataset format (which hub datasets follow) puts preference answers, KTO labels,
images and tools beside the conversation. Training on the conversation alone would drop
what such a column says without a word, so a row schema refuses it with a RowError naming
the column, what it is for and the fix. Columns swiftlm does not know (`id`, `source` ...)
are not refused: loading counts them and reports them once as not used.
"""

from __future__ import annotations

from typing import Any

from swiftlm.data.rows import RowError

PREFERENCE = "preference data for swiftlm rlhf (DPO)"
MULTIMODAL = (
    "images need a vision-language --model (Qwen2-VL, LLaVA, SmolVLM/Idefics3 ...; sft, rlhf "
    "--rlhf_type dpo, infer and deploy take images), and this {method} run's model is text-only"
)

# column -> (what it holds, the kind of RowError)
OTHER_METHOD_COLUMNS: dict[str, tuple[str, str]] = {
    "rejected_response": (PREFERENCE, "column for another method"),
    "rejected_messages": (PREFERENCE, "column for another method"),
    "chosen": (PREFERENCE, "column for another method"),
    "rejected": (PREFERENCE, "column for another method"),
    "label": (
        "a KTO desirability label or a classification label, for swiftlm rlhf "
        "--rlhf_type kto or sequence classification (not available yet)",
        "column for another method",
    ),
    "margin": (
        "a reward-model margin, read by swiftlm rlhf --rlhf_type rm",
        "column for another method",
    ),
    "images": ("images for the <image> tags of the text", "media"),
    "videos": ("videos for the <video> tags of the text", "media"),
    "audios": ("audio for the <audio> tags of the text", "media"),
    "rejected_images": ("images of rejected answers", "media"),
    "objects": ("grounding boxes for images", "media"),
}

TOOLS_FOR_SFT = ("tool-calling data, which swiftlm sft trains on", "column for another method")


def given(value: Any) -> bool:
    """Whether a column holds something: parquet and hub datasets fill absent columns with
    None, and mixed datasets leave empty lists or strings on rows without that data."""
    return value is not None and value != [] and value != ""


def refuse_other_method_columns(record: dict, method: str, also: dict | None = None) -> None:
    """Raise a RowError for the first column of OTHER_METHOD_COLUMNS (and `also`, extra
    column -> (what, kind) rules of this method) that the row fills."""
    rules = {**OTHER_METHOD_COLUMNS, **(also or {})}
    for column, (what, kind) in rules.items():
        if given(record.get(column)):
            raise RowError(kind, _message(column, what, kind, method))


def _message(column: str, what: str, kind: str, method: str) -> str:
    if kind == "media":
        return (
            f"column {column!r} holds {what}; {MULTIMODAL.format(method=method)}: pass a "
            "vision-language --model, or remove the column (and its tags)"
        )
    return f"column {column!r} is {what}; {method} does not use it: remove the column"


def refuse_media_parts(messages: list[dict], method: str) -> None:
    """Raise a RowError for the first message holding image parts."""
    for index, message in enumerate(messages, start=1):
        content = message["content"]
        count = 0 if isinstance(content, str) else sum(p["type"] == "image" for p in content)
        if count:
            raise RowError(
                "media",
                f"message {index} ({message['role']}) has {count} image part(s); "
                f"{MULTIMODAL.format(method=method)}: remove the image parts",
            )
