"""Image content parts of `/v1/chat/completions`.

OpenAI's `{"type": "image_url", "image_url": {"url": ...}}` parts are taken by a
vision-language model (served by engine.vision.VisionEngine: transformers' generate, one
request at a time; continuous batching is text-only). The url may be:

- a data URL, `data:image/png;base64,...` (what the openai client sends for local files);
- an http(s) URL, downloaded by the server (once; cached under the swiftlm cache);
- a path or `file://` URL on the server's machine, only when the server was started with
  `--allow_local_images` (otherwise a client could make the server read its files).

Every image is decoded before the request is queued: a bad one (undecodable, not an image,
an unreachable URL, a refused path) is a 400 naming `messages[i].content[j]`, never a 500.
Image parts sent to a text-only model are a 400 that says which model to serve.
"""

from __future__ import annotations

from swiftlm.data.images import URL_SCHEMES, resolve_image
from swiftlm.data.parts import flatten_text_parts
from swiftlm.data.rows import RowError
from swiftlm.engine.vision import VisionPrompt
from swiftlm.serve.errors import APIError
from swiftlm.serve.schemas import ChatCompletionRequest
from swiftlm.serve.tools import check_renders_tools, template_message, template_tools

VISION_MODELS = "a vision-language model (Qwen2-VL, LLaVA, SmolVLM/Idefics3 ...)"


def _where(message: int, part: int) -> tuple[str, str]:
    """How a part is named in messages, and as the error's `param`."""
    return f"messages[{message}].content[{part}]", f"messages.{message}.content.{part}"


def reject_images(request: ChatCompletionRequest, model: str) -> None:
    """400 for the first image part sent to a text-only model."""
    for index, message in enumerate(request.messages):
        for part, _ in message.image_parts():
            where, param = _where(index, part)
            raise APIError(
                400,
                f"'{where}' is an image, and the served model '{model}' is text-only; send "
                f"text only, or serve {VISION_MODELS} with swiftlm deploy",
                param=param,
                code="images_not_supported",
            )


def image_reference(url: str, where: str, allow_local: bool) -> str:
    """The checked reference of one image part's url (data.images.resolve_image); RowError
    when it cannot be used."""
    url = url.strip()
    if not url:
        raise RowError("bad image", f"'{where}' has an empty image_url.url")
    remote = url.startswith("data:") or url.startswith(URL_SCHEMES)
    if not remote and not allow_local:
        raise RowError(
            "bad image",
            f"'{where}': image_url.url must be a data URL (data:image/png;base64,...) or an "
            "http(s) URL; paths of files on the server are refused unless it was started with "
            "--allow_local_images",
        )
    return resolve_image(url, f"'{where}'")


def vision_messages(
    request: ChatCompletionRequest, system: str | None, allow_local: bool
) -> list[dict]:
    """The request's messages with image parts as checked canonical parts
    (`{"type": "image", "image": reference}`); 400 naming the first bad image."""
    messages = []
    for index, message in enumerate(request.messages):
        out = template_message(message)
        if message.image_parts():
            parts = []
            for number, part in enumerate(message.content):
                if part.type == "text":
                    parts.append({"type": "text", "text": part.text})
                    continue
                where, param = _where(index, number)
                try:
                    reference = image_reference(part.image_url.url, where, allow_local)
                except RowError as exc:
                    raise APIError(400, str(exc), param=param, code="invalid_image") from None
                parts.append({"type": "image", "image": reference})
            out["content"] = parts
        messages.append(out)
    if system is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


def vision_prompt(
    engine, request: ChatCompletionRequest, system: str | None, allow_local: bool
) -> VisionPrompt:
    """The request rendered and processed by the model's processor (ids with image tokens,
    pixel features); 400 for a bad image, a refused template, or fields the vision
    generator does not support."""
    if request.logprobs:
        raise APIError(
            400,
            "'logprobs': not supported with a vision-language model (it generates through "
            "transformers' generate, not the text engine); leave it out",
            param="logprobs",
        )
    if request.response_format is not None and request.response_format.type != "text":
        raise APIError(
            400,
            "'response_format': structured output is not supported with a vision-language "
            "model (it generates through transformers' generate, not the text engine)",
            param="response_format",
        )
    messages = vision_messages(request, system, allow_local)
    tools = template_tools(request)
    try:
        if tools:
            check_renders_tools(lambda t: _render(engine, messages, t), tools)
        return engine.encode(messages, tools)
    except APIError:
        raise
    except RowError as exc:  # an image that resolved but does not decode
        raise APIError(400, f"'messages': {exc}", param="messages", code="invalid_image") from None
    except Exception as exc:  # a template may raise on roles or orders it does not accept
        raise APIError(
            400,
            f"'messages': the model's chat template or processor refused them: {exc}",
            param="messages",
        ) from None


def _render(engine, messages: list[dict], tools: list[dict] | None) -> str:
    extra = {"tools": tools} if tools else {}
    return engine.tokenizer.apply_chat_template(
        flatten_text_parts(messages), tokenize=False, add_generation_prompt=True, **extra
    )
