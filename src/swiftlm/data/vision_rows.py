"""Rows with images: `<image>` tags plus an `images` list (ms-swift), or image content parts
(OpenAI `image_url`, ms-swift `image`), for conversations and preference pairs.

Both spellings become canonical image parts (`{"type": "image", "image": reference}`) at the
place of their tag, with every reference checked (data.images): a row whose tags and images
do not pair up, or whose image is missing, damaged or of another format, is a RowError
(`file:line: reason`), never a silent substitution.
"""

from __future__ import annotations

from pathlib import Path

from swiftlm.data.columns import given
from swiftlm.data.formats import chat_sample
from swiftlm.data.images import resolve_image
from swiftlm.data.parts import content_images
from swiftlm.data.preference import preference_sample
from swiftlm.data.rows import RowError, type_name

IMAGE_TAG = "<image>"
IMAGE_COLUMNS = ("images", "rejected_images")


def vision_chat_sample(record: dict, **options) -> dict:
    """chat_sample's schema (and its options: `require_answer`, `system`, `placeholders`,
    `method`), with the row's images attached and checked."""
    images = _image_list(record.get("images"), "images")
    text_record = {k: v for k, v in record.items() if k != "images"}
    sample = chat_sample(text_record, **options)
    sample["messages"] = attach_images(sample["messages"], images, "images")
    return sample


def vision_preference_sample(record: dict, *, method: str, system: str | None = None) -> dict:
    """preference_sample's schema with images: `images` fill the tags of the chosen
    conversation, and of the rejected one unless `rejected_images` are given for it."""
    images = _image_list(record.get("images"), "images")
    rejected_images = _image_list(record.get("rejected_images"), "rejected_images")
    text_record = {k: v for k, v in record.items() if k not in IMAGE_COLUMNS}
    sample = preference_sample(text_record, method=method, system=system, images=True)
    rejected_column = "rejected_images" if given(record.get("rejected_images")) else "images"
    return {
        "chosen": attach_images(sample["chosen"], images, "images"),
        "rejected": attach_images(sample["rejected"], rejected_images or images, rejected_column),
    }


def _image_list(value, column: str) -> list[str]:
    """A row's image column as a list of references (a single string is one image)."""
    if not given(value):
        return []
    values = [value] if isinstance(value, str | dict) else value
    if not isinstance(values, list):
        raise RowError(
            "bad field type", f"'{column}' must be a list of image paths, got {type_name(value)}"
        )
    references = []
    for index, item in enumerate(values, start=1):
        reference = item.get("path") or item.get("url") if isinstance(item, dict) else item
        if not isinstance(reference, str) or not reference.strip():
            raise RowError(
                "bad field type",
                f"'{column}' item {index} must be an image path, URL or base64 string "
                f"(or {{'path': ...}}), got {type_name(item)}",
            )
        references.append(reference)
    return references


def attach_images(messages: list[dict], images: list[str], column: str) -> list[dict]:
    """Messages with each `<image>` tag replaced by the next image of `images` (as a part),
    and every image part's reference checked. The tags must use up exactly the images."""
    tags = sum(_tag_count(m["content"]) for m in messages)
    if tags != len(images):
        raise RowError("image tags", _count_message(tags, len(images), column))
    queue = iter(images)
    attached = [{**m, "content": _split_tags(m["content"], queue)} for m in messages]
    number = 0
    checked = []
    for message in attached:
        content = message["content"]
        if not isinstance(content, str):
            parts = []
            for part in content:
                if part["type"] == "image":
                    number += 1
                    part = {
                        "type": "image",
                        "image": resolve_image(part["image"], f"image {number}"),
                    }
                parts.append(part)
            content = parts
        checked.append({**message, "content": content})
    return checked


def local_image_files(samples: list[dict]) -> list[str]:
    """The local image files of samples' conversations (`messages`, or a pair's `chosen` and
    `rejected`): inline and downloaded images are not files the data cache must watch."""
    files = []
    for sample in samples:
        for key in ("messages", "chosen", "rejected"):
            for message in sample.get(key, []):
                files += [
                    ref for ref in content_images(message["content"]) if not ref.startswith("data:")
                ]
    return [ref for ref in files if not _in_download_cache(ref)]


def _in_download_cache(path: str) -> bool:
    from swiftlm.models.loader import cache_root

    return Path(path).parent == cache_root() / "images"


def count_images(messages: list[dict]) -> int:
    return sum(len(content_images(m["content"])) for m in messages)


def _tag_count(content) -> int:
    if isinstance(content, str):
        return content.count(IMAGE_TAG)
    return sum(p["text"].count(IMAGE_TAG) for p in content if p["type"] == "text")


def _count_message(tags: int, images: int, column: str) -> str:
    if not images:
        return (
            f"the messages hold {tags} {IMAGE_TAG} tag(s) but the row has no '{column}'; add the "
            f"images in order, or remove the tags"
        )
    return (
        f"the messages hold {tags} {IMAGE_TAG} tag(s) but '{column}' lists {images} image(s); "
        f"put one {IMAGE_TAG} tag where each image goes in the conversation"
    )


def _split_tags(content, queue) -> str | list[dict]:
    """Content with its tags turned into image parts (unchanged when it has none)."""
    if isinstance(content, str):
        if IMAGE_TAG not in content:
            return content
        content = [{"type": "text", "text": content}]
    parts: list[dict] = []
    for part in content:
        if part["type"] != "text" or IMAGE_TAG not in part["text"]:
            parts.append(part)
            continue
        pieces = part["text"].split(IMAGE_TAG)
        for index, piece in enumerate(pieces):
            if index:
                parts.append({"type": "image", "image": next(queue)})
            if piece:
                parts.append({"type": "text", "text": piece})
    return parts
