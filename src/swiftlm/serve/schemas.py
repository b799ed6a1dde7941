"""OpenAI request bodies for `/v1/chat/completions` and `/v1/completions` (pydantic).

Unknown fields are refused (`extra="forbid"`): a typo such as `max_token` must not be silently
ignored. A few OpenAI fields are accepted and ignored, each for a stated reason
(`IGNORED_FIELDS`); the fields of features not built yet are declared so that a request using
them gets a 400 that says so (`UNSUPPORTED_FIELDS`), never a silent default.
"""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

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


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


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
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if part.type == "text")
        return self.content or ""

    def image_parts(self) -> list[tuple[int, "ImagePart"]]:
        """(index in content, part) of each image part."""
        if not isinstance(self.content, list):
            return []
        return [(i, part) for i, part in enumerate(self.content) if part.type == "image_url"]


class SamplingFields(Strict):
    """Fields that chat and completions requests share."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: str | list[str] | None = Field(default=None)
    seed: int | None = None
    # vLLM's extras, which its OpenAI server accepts in the same body.
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    # See IGNORED_FIELDS.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # See UNSUPPORTED_FIELDS.
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
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


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None

    # Declared in UNSUPPORTED_FIELDS for /v1/completions; supported here.
    SUPPORTED: ClassVar[tuple[str, ...]] = ("tools", "tool_choice", "response_format")

    def token_budget(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    echo: bool = False
    logprobs: int | None = None  # how many alternatives per token; 0: the chosen token only

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def token_budget(self) -> int | None:
        return self.max_tokens
