"""Images of `swiftlm infer` with a vision-language model: `--images` and `/image` in the chat,
and the image rows of a batch file.

A question's images fill its `<image>` tags in order; a question without any tag gets them
all in front of its text (one image part each), as ms-swift's infer does. References are
checked with data.images.resolve_image (the file exists and decodes, the URL downloads)
before anything is generated.
"""

from __future__ import annotations

from swiftlm.data.columns import refuse_media_parts
from swiftlm.data.formats import RowError, chat_sample
from swiftlm.data.images import resolve_image
from swiftlm.data.vision_rows import IMAGE_TAG, attach_images, vision_chat_sample
from swiftlm.engine.build import InferenceModel
from swiftlm.engine.vision import is_vision_model
from swiftlm.errors import ConfigError

IMAGE_COMMAND = "/image"
TEXT_ONLY = (
    "{what}: {model} is a text-only model; images need a vision-language model (Qwen2-VL, "
    "LLaVA, SmolVLM/Idefics3 ...)"
)


def check_images(images: list[str], spec: InferenceModel) -> list[str]:
    """`--images` checked before the model loads: the model takes images, each one reads."""
    if not images:
        return []
    if not is_vision_model(spec.base_path):
        raise ConfigError(
            TEXT_ONLY.format(what="--images", model=spec.base_path) + "; drop --images"
        )
    return resolve_references(images, "--images")


def resolve_references(images: list[str], flag: str) -> list[str]:
    """Each reference checked (data.images.resolve_image); ConfigError naming the bad one."""
    resolved = []
    for number, reference in enumerate(images, start=1):
        try:
            resolved.append(resolve_image(reference, f"{flag} image {number}"))
        except RowError as exc:
            raise ConfigError(str(exc)) from None
    return resolved


def question_content(text: str, images: list[str]) -> str | list[dict]:
    """The content of a question with `images` (checked references): they fill its `<image>`
    tags in order, or go in front of its text when it has none. RowError when the tags and
    the images do not pair up."""
    tags = text.count(IMAGE_TAG)
    if not images:
        if tags:
            raise RowError(
                "image tags",
                f"the question has {tags} {IMAGE_TAG} tag(s) but no image is attached; attach "
                f"images with `{IMAGE_COMMAND} PATH ...` first, or remove the tags",
            )
        return text
    if tags and tags != len(images):
        raise RowError(
            "image tags",
            f"the question has {tags} {IMAGE_TAG} tag(s) but {len(images)} image(s) are "
            f"attached; put one {IMAGE_TAG} tag where each image goes, or none to have them all "
            "in front of the text",
        )
    if not tags:
        text = IMAGE_TAG * len(images) + text
    message = attach_images([{"role": "user", "content": text}], images, "images")[0]
    return message["content"]


def vision_prompt_sample(record: dict, **options) -> dict:
    """A chat sample to answer with a vision-language model: `<image>` tags filled from the
    row's `images` (paths relative to the data file's folder), image_url/image parts kept,
    every image checked (a bad one is a RowError, reported as file:line before generating)."""
    sample = vision_chat_sample(record, **options)
    _refuse_tools(sample)
    return sample


def text_prompt_sample(record: dict, **options) -> dict:
    """A chat sample to answer with a text model. Images, tools and tool calls are refused:
    the engine renders text-only prompts without tools, and would answer as if they did not
    exist."""
    sample = chat_sample(record, **options)
    refuse_media_parts(sample["messages"], "infer")
    _refuse_tools(sample)
    return sample


def _refuse_tools(sample: dict) -> None:
    if "tools" in sample or any(m.get("tool_calls") for m in sample["messages"]):
        raise RowError(
            "tool calls",
            "the row has tools or tool calls, which swiftlm infer does not pass to the chat "
            "template yet: remove the 'tools' column and the tool-call turns",
        )
