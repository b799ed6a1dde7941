"""Tool calling: OpenAI messages and tools -> the chat template; the model's text -> tool calls.

Requests: an assistant turn's `tool_calls` carry their arguments as JSON text (OpenAI's wire
format) while chat templates (Qwen2.5, Hermes, Llama 3.1...) expect a dict, so arguments are
decoded here; `tool` turns pass through with their `tool_call_id`.

Answers: a parser, picked by name from `TOOL_PARSERS`, splits the generated text into content
and calls. Hermes' format (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, as
Qwen2.5 and Hermes models write it) is the default; a call whose JSON does not parse is left in
the content, never dropped and never an error.
"""

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from swiftlm.serve.errors import APIError
from swiftlm.serve.schemas import ChatCompletionRequest, ChatMessage


def template_message(message: ChatMessage) -> dict:
    role = "system" if message.role == "developer" else message.role
    out: dict = {"role": role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None and role == "tool":
        out["name"] = message.name
    return out


def _arguments(call) -> dict:
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise APIError(
            400,
            f"'messages': tool call {call.id} of '{call.function.name}': arguments must be a "
            "JSON object as text",
            param="messages",
        )
    return arguments


def template_tools(request: ChatCompletionRequest) -> list[dict] | None:
    """The tools to show the model; None when there are none or tool_choice is "none"."""
    if not request.tools or request.tool_choice == "none":
        return None
    return [tool.model_dump(exclude_none=True) for tool in request.tools]


def check_renders_tools(render: Callable[[list[dict] | None], str], tools: list[dict]) -> None:
    """400 when the chat template ignores `tools`: the model would never hear of them."""
    if render(tools) == render(None):
        raise APIError(
            400,
            "'tools': this model's chat template does not render tools, so the model cannot "
            "call them. Serve a model whose template supports tools (e.g. Qwen2.5-Instruct, "
            "Hermes-3), or describe the functions in a system message yourself",
            param="tools",
            code="tools_not_supported_by_template",
        )


# -- parsing the answer ------------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict

    def openai(self) -> dict:
        """The `message.tool_calls` entry, arguments as JSON text as OpenAI sends them."""
        return {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> tuple[str, list[ParsedCall]]:
    """(content left, calls) from `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    blocks. A block whose JSON does not parse, or lacks a name, stays in the content."""
    calls: list[ParsedCall] = []
    kept: list[str] = []
    position = 0
    for match in HERMES_CALL.finditer(text):
        call = _hermes_call(match.group(1))
        if call is None:
            continue  # stays in the content
        calls.append(call)
        kept.append(text[position : match.start()])
        position = match.end()
    kept.append(text[position:])
    return "".join(kept).strip(), calls


def _hermes_call(body: str) -> ParsedCall | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(data["name"], arguments)


# Name -> parser; `swiftlm deploy` uses "hermes" unless told otherwise.
TOOL_PARSERS: dict[str, Callable[[str], tuple[str, list[ParsedCall]]]] = {"hermes": parse_hermes}
DEFAULT_TOOL_PARSER = "hermes"
# What a forced call (tool_choice "required" or a named function) must look like, per parser:
# the text around one call's JSON.
FORCED_CALL_TAGS = {"hermes": ("<tool_call>\n", "\n</tool_call>")}


def tool_message(text: str, parser: str = DEFAULT_TOOL_PARSER) -> tuple[dict, bool]:
    """The assistant `message` for `text`, and whether it holds tool calls."""
    content, calls = TOOL_PARSERS[parser](text)
    if not calls:
        return {"role": "assistant", "content": text}, False
    message = {
        "role": "assistant",
        "content": content or None,
        "tool_calls": [call.openai() for call in calls],
    }
    return message, True
