"""The grammar a chat request's output must follow: `response_format` (JSON, a JSON schema) or a
forced tool call (`tool_choice` "required" or a named function).

Enforced while decoding (engine/grammar.py), not checked afterwards: every token the model may
pick keeps the output valid, so even a weak model's answer parses. Compiling happens here,
before the engine, so a schema xgrammar cannot handle is a 400 that names it.
"""

import threading

from swiftlm.serve.errors import APIError
from swiftlm.serve.schemas import ChatCompletionRequest, NamedToolChoice
from swiftlm.serve.tools import DEFAULT_TOOL_PARSER, FORCED_CALL_TAGS


class Constraints:
    """Builds request constraints for one tokenizer; xgrammar loads on first use only."""

    def __init__(self, tokenizer, stop_token_ids):
        self.tokenizer = tokenizer
        self.stop_token_ids = list(stop_token_ids)
        self._grammars = None
        self._lock = threading.Lock()

    def grammars(self):
        with self._lock:
            if self._grammars is None:
                try:
                    from swiftlm.engine.grammar import Grammars

                    self._grammars = Grammars(self.tokenizer, self.stop_token_ids)
                except ImportError as exc:
                    raise APIError(501, str(exc), code="structured_output_unavailable") from None
            return self._grammars

    def for_request(self, request: ChatCompletionRequest, parser: str = DEFAULT_TOOL_PARSER):
        """The request's constraint, or None; 400 for a combination or schema that cannot be."""
        forced = forced_functions(request)
        fmt = request.response_format
        if forced and fmt is not None and fmt.type != "text":
            raise APIError(
                400,
                "'response_format': cannot be combined with a forced tool call "
                "(tool_choice 'required' or a named function)",
                param="response_format",
            )
        if forced:
            if parser not in FORCED_CALL_TAGS:
                raise APIError(
                    400,
                    f"'tool_choice': a forced tool call needs a parser that says how a call "
                    f"begins and ends; the server's parser {parser!r} does not (give "
                    "tool_choice 'auto', or register the parser with forced_call_tags)",
                    param="tool_choice",
                )
            begin, end = FORCED_CALL_TAGS[parser]
            try:
                return self.grammars().tagged_json(call_schema(forced), begin, end)
            except ValueError as exc:
                raise APIError(400, f"'tools': {exc}", param="tools") from None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return self.grammars().json_object()
        if fmt.json_schema is None:
            raise APIError(
                400,
                "'response_format': type 'json_schema' needs a 'json_schema' object with "
                "'name' and 'schema'",
                param="response_format",
            )
        strict = fmt.json_schema.strict is not False
        try:
            return self.grammars().json_schema(fmt.json_schema.json_schema_, strict=strict)
        except ValueError as exc:
            raise APIError(400, f"'response_format': {exc}", param="response_format") from None


def forced_functions(request: ChatCompletionRequest) -> list[dict]:
    """The function definitions one of which the answer must call: all tools for "required",
    the named one for `{"type": "function", ...}`; empty when the model may answer freely."""
    choice = request.tool_choice
    if choice is None or choice in ("auto", "none"):
        return []
    tools = request.tools or []
    if not tools:
        raise APIError(400, "'tool_choice': needs 'tools'", param="tool_choice")
    functions = [tool.function for tool in tools]
    if isinstance(choice, NamedToolChoice):
        functions = [f for f in functions if f.name == choice.function.name]
        if not functions:
            names = ", ".join(tool.function.name for tool in tools)
            raise APIError(
                400,
                f"'tool_choice': no tool is named '{choice.function.name}'; tools: {names}",
                param="tool_choice",
            )
    return [f.model_dump(exclude_none=True) for f in functions]


def call_schema(functions: list[dict]) -> dict:
    """JSON schema of one call `{"name": ..., "arguments": {...}}` to any of `functions`."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object", "properties": {}},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}
