"""OpenAI request bodies for `/v1/chat/completions` and `/v1/completions` (pydantic).

Fields are typed as OpenAI's API types them, strictly: `"stream": "yes"`, `"n": "2"` or
`"max_tokens": 5.5` are 400s, not coerced (an integer is still a number: `"temperature": 1` is
valid). Every sampling field is range-checked here, with OpenAI's ranges where OpenAI has them
(vLLM's where only vLLM has the field), so that no client value can fail inside the engine.
Unknown fields are refused (`extra="forbid"`): a typo such as `max_token` must not be silently
ignored. A few OpenAI fields are accepted and ignored, each for a stated reason
(`IGNORED_FIELDS`); the fields of features not built yet are declared so that a request using
them gets a 400 that says so (`UNSUPPORTED_FIELDS`), never a silent default.

A field that takes several forms (a string or a list ...) is a union picked by the value's JSON
type (`one_of`), so that a wrong value gets one error saying which forms are accepted.
"""

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from swiftlm.serve.errors import FORM_ERROR, UNION_TAG

# Accepted, and deliberately without effect.
IGNORED_FIELDS = {
    "user": "identifies the end user for OpenAI's abuse monitoring; there is none here",
    "metadata": "tags stored completions on OpenAI's side; nothing is stored here",
    "store": "asks OpenAI to keep the completion; nothing is stored here",
}
# Set to anything but null: 400 naming the field and saying it is not supported (yet).
UNSUPPORTED_FIELDS = {
    # Chat requests accept tools, tool_choice and response_format (ChatCompletionRequest
    # redeclares them); on /v1/completions they stay refused.
    "tools": "tools are supported on /v1/chat/completions only",
    "tool_choice": "tools are supported on /v1/chat/completions only",
    "parallel_tool_calls": "parallel_tool_calls is not supported; the model decides",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "response_format": "response_format is supported on /v1/chat/completions only",
    "logit_bias": "logit_bias is not supported",
    "suffix": "suffix (insertion) is not supported",
    "best_of": "best_of is not supported; use n",
    "modalities": "only text output is supported",
    "audio": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning_effort is not supported",
}

# OpenAI's limits.
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
MAX_N = 128  # the server's --max_n lowers it
LOGIT_BIAS_RANGE = 100.0
INT64 = (-(2**63), 2**63 - 1)  # OpenAI types seed as a 64-bit signed integer
# Above any real vocabulary or context, below what the engine's int64 tensors hold.
MAX_COUNT = 2**31 - 1

Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]


def one_of(described: str, **forms: tuple[Any, Callable[[Any], bool]]):
    """A union whose member is picked by `forms[name][1](value)` (the first that holds): a
    value of no form gets the one error "must be `described`" instead of one error per member;
    a value of one form gets only that member's errors. Members are tagged `UNION_TAG + name`
    so that error locations can leave the tag out."""
    members = tuple(Annotated[kind, Tag(UNION_TAG + name)] for name, (kind, _) in forms.items())

    def pick(value: Any) -> str | None:
        for name, (_, matches) in forms.items():
            if matches(value):
                return UNION_TAG + name
        return None

    return Annotated[
        Union[members],  # noqa: UP007 (the members are built at run time)
        Discriminator(
            pick, custom_error_type=FORM_ERROR, custom_error_message=f"must be {described}"
        ),
    ]


def _is_list(value: Any) -> bool:
    return isinstance(value, list)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_object(value: Any) -> bool:
    return isinstance(value, (dict, BaseModel))


def _part_type(value: Any) -> Any:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


class Strict(BaseModel):
    # strict: JSON types as OpenAI's API types them (an int is still a valid float);
    # allow_inf_nan off: Python's JSON parser reads NaN and Infinity, which no range holds.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageURL(Strict):
    url: str  # data:image/...;base64,..., http(s)://..., or (--allow_local_images) a path
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the processor decides


class ImagePart(Strict):
    """OpenAI's image content part; only a vision-language model takes it (serve.vision)."""

    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = one_of(
    'a content part: {"type": "text", "text": ...} or {"type": "image_url", "image_url": '
    '{"url": ...}}',
    text=(TextPart, lambda v: _part_type(v) == "text"),
    image_url=(ImagePart, lambda v: _part_type(v) == "image_url"),
)
Content = one_of(
    "a string, a list of content parts, or null (only in an assistant message with tool_calls)",
    string=(str, _is_str),
    parts=(list[ContentPart], _is_list),
)


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers

    @model_validator(mode="after")
    def _content_or_calls(self) -> "ChatMessage":
        # OpenAI: only an assistant turn that called tools may leave its content out; anything
        # else would reach the chat template as an empty turn the client did not mean.
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError(
                FORM_ERROR,
                "is null; give the message's text (only an assistant message with tool_calls "
                "may leave content out)",
                {"at": ".content"},
            )
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if part.type == "text")
        return self.content or ""

    def image_parts(self) -> list[tuple[int, "ImagePart"]]:
        """(index in content, part) of each image part."""
        if not isinstance(self.content, list):
            return []
        return [(i, part) for i, part in enumerate(self.content) if part.type == "image_url"]


Stop = one_of(
    f"a string or a list of at most {MAX_STOP_STRINGS} strings",
    string=(str, _is_str),
    strings=(Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)], _is_list),
)


class SamplingFields(Strict):
    """Fields that chat and completions requests share, with OpenAI's ranges (vLLM's for
    top_k, min_p and repetition_penalty)."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    max_tokens: Count | None = None
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    stop: Stop | None = None
    seed: int | None = Field(default=None, ge=INT64[0], le=INT64[1])
    # vLLM's extras, which its OpenAI server accepts in the same body.
    top_k: int = Field(default=0, ge=0, le=MAX_COUNT)  # 0: off
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0, le=100)
    ignore_eos: bool = False
    # See IGNORED_FIELDS.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # See UNSUPPORTED_FIELDS; checked as OpenAI checks them all the same, so that a malformed
    # value is named as such rather than as a feature not built.
    logit_bias: (
        dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_RANGE, le=LOGIT_BIAS_RANGE)]] | None
    ) = None
    best_of: Count | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    suffix: Any = None

    SUPPORTED: ClassVar[tuple[str, ...]] = ()  # names of UNSUPPORTED_FIELDS a subclass handles

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        # JSON may escape half of a UTF-16 pair ("\ud800"), which is no character: tokenizers,
        # grammars and UTF-8 output all fail on it, so it is refused before anything runs.
        where = lone_surrogate(body)
        if where is not None:
            raise PydanticCustomError(
                FORM_ERROR,
                "holds an unpaired UTF-16 surrogate (an escape in \\ud800-\\udfff without "
                "its pair), which is no character; send valid Unicode text",
                {"at": where},
            )
        return body

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not (key.isascii() and key.isdigit()):
                raise PydanticCustomError(
                    FORM_ERROR,
                    "keys must be token ids (integers as strings, e.g. \"1234\"); '{key}' is not",
                    {"key": key},
                )
        return bias

    def unsupported_field(self) -> tuple[str, str] | None:
        """(field, reason) of the first field set that names a feature not supported."""
        for name, reason in UNSUPPORTED_FIELDS.items():
            value = getattr(self, name, None)
            if name in self.SUPPORTED or value is None or (name == "best_of" and value == self.n):
                continue
            return name, reason
        return None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    # "schema" would shadow pydantic's BaseModel.schema: stored as json_schema_.
    json_schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


ToolChoice = one_of(
    '"none", "auto", "required", or {"type": "function", "function": {"name": ...}}',
    mode=(Literal["none", "auto", "required"], _is_str),
    function=(NamedToolChoice, _is_object),
)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    response_format: ResponseFormat | None = None
    max_completion_tokens: Count | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    # Declared in UNSUPPORTED_FIELDS for /v1/completions; supported here.
    SUPPORTED: ClassVar[tuple[str, ...]] = ("tools", "tool_choice", "response_format")

    def token_budget(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )


PROMPT_FORMS = (
    "'prompt' must be a string, a list of strings, a list of token ids (integers of at least 0) "
    "or a list of token-id lists"
)
# A prompt: text, or token ids the client tokenized itself.
Prompt = str | list[int]


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    # How many alternatives per token; 0: the chosen token only.
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt_form(cls, value: Any) -> Any:
        # By hand rather than a union: the error names the element that breaks the form
        # ("prompt[2]") and lists the forms once, instead of one message per union member.
        problem = prompt_problem(value)
        if problem:
            where, what = problem
            raise PydanticCustomError(FORM_ERROR, f"{what}; {PROMPT_FORMS}", {"at": where})
        return value

    def prompts(self) -> list[Prompt]:
        """One prompt per sample group: a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and _is_token_id(prompt[0])):
            return [prompt]
        return list(prompt)

    def token_budget(self) -> int | None:
        return self.max_tokens


def lone_surrogate(value: Any, where: str = "") -> str | None:
    """Where in a JSON value (`messages[0].content`) the first string that is not valid
    Unicode is, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            # The location is shown to the client: escaped, so it is valid text itself.
            name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")
            inside = f"{where}.{name}" if where else name
            found = lone_surrogate(key, inside) or lone_surrogate(item, inside)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate(item, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def _is_token_id(value: Any) -> bool:
    # bool is an int in Python, not in JSON.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _kind(value: Any) -> str:
    """How JSON would call `value`, for error messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "a negative integer" if value < 0 else "an integer"
    names = {str: "a string", float: "a number", list: "a list", dict: "an object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def prompt_problem(value: Any) -> tuple[str, str] | None:
    """(where, what is wrong) of the first part of `value` that is no prompt form, or None.
    `where` follows "prompt": "" or "[2]" or "[1][3]"."""
    if isinstance(value, str):
        return None
    if not isinstance(value, list):
        return "", f"is {_kind(value)}"
    if not value:
        return "", "is an empty list"
    first = value[0]
    if isinstance(first, str):
        return _all_of(value, _is_str, "in a list of strings")
    if _is_token_id(first):
        return _all_of(value, _is_token_id, "in a list of token ids")
    if isinstance(first, list):
        for i, ids in enumerate(value):
            if not isinstance(ids, list) or not ids:
                what = "an empty list" if ids == [] else _kind(ids)
                return f"[{i}]", f"is {what} in a list of token-id lists"
            bad = _all_of(ids, _is_token_id, "in a list of token ids")
            if bad:
                return f"[{i}]{bad[0]}", bad[1]
        return None
    return "[0]", f"is {_kind(first)} at the start of a list"


def _all_of(values: list, ok: Callable[[Any], bool], context: str) -> tuple[str, str] | None:
    for i, v in enumerate(values):
        if not ok(v):
            return f"[{i}]", f"is {_kind(v)} {context}"
    return None
