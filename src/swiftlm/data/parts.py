"""Message content given as a list of parts: reading, text and images of canonical parts.

Canonical parts are `{"type": "text", "text": str}` and `{"type": "image", "image": str}` (a
path or URL). Rows may write them OpenAI-style (`{"type": "image_url", "image_url": {"url":
...}}`, or `"image_url": "..."`) or ms-swift-style (`{"type": "image", "image": ...}`).
"""

from __future__ import annotations

from typing import Any

from swiftlm.data.rows import RowError, type_name

PART_TYPES = "'text', 'image_url' or 'image'"
PART_EXAMPLES = {
    "text": '{"type": "text", "text": "..."}',
    "image_url": '{"type": "image_url", "image_url": {"url": "cat.png"}}',
    "image": '{"type": "image", "image": "cat.png"}',
}


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


def parse_part(part: Any, where: str) -> dict:
    """One content part -> its canonical form; raise RowError naming the part and the fix."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise RowError(
                "bad content part",
                f"{where} has no string 'text' (got {type_name(text)}); "
                f"write {PART_EXAMPLES['text']}",
            )
        return {"type": "text", "text": text}
    if kind in ("image_url", "image"):
        return {"type": "image", "image": _image_reference(part, kind, where)}
    if not isinstance(part, dict):
        problem = f"is {type_name(part)}"
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
            f"{where} needs a string {field} (got {type_name(value)}); write {PART_EXAMPLES[kind]}",
        )
    if not value.strip():
        raise RowError(
            "bad content part", f"{where} has an empty {field}; give an image path or URL"
        )
    return value
