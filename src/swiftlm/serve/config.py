"""The config section of `swiftlm deploy`, the OpenAI-compatible server. Same conventions as
`config/sections.py`: field names are the flag names (ms-swift's where they exist), each field's
`help` is its `--help` text, the section checks its own fields when built.
"""

from dataclasses import dataclass

from swiftlm.config.checks import above, at_least, check_fields, within
from swiftlm.config.sections import doc

MIB = 1024 * 1024


@dataclass
class DeployArguments:
    host: str = doc(
        "Address to bind. The default answers only this machine; 0.0.0.0 opens the server to "
        "the network (set --api_key then).",
        default="127.0.0.1",
    )
    port: int = doc("TCP port to listen on.", default=8000)
    api_key: list[str] = doc(
        "Accepted API keys (several allowed): every route but /health and the chat page / then needs "
        "`Authorization: Bearer <key>`. None given: no authentication.",
        default_factory=list,
    )
    served_model_name: str | None = doc(
        "Name under which the base model is served (the `model` field of requests). "
        "Default: the model's folder or hub name.",
        default=None,
    )
    tool_call_parser: str = doc(
        "How tool calls are read from generated text: hermes (`<tool_call>{json}</tool_call>`, "
        "Qwen2.5/Hermes templates), or the name of a parser a plugin registers "
        "(--external_plugins, docs/plugins.md).",
        default="hermes",
    )
    max_num_seqs: int = doc(
        "Most sequences decoded together in one batch. Text models only: a vision-language "
        "model answers one request at a time (continuous batching is text-only).",
        default=32,
    )
    max_model_len: int | None = doc(
        "Longest sequence (prompt + generated tokens). Default: the model's context length.",
        default=None,
    )
    max_queued_requests: int = doc(
        "Requests waiting for a batch slot, at most; beyond it the server answers 429 with "
        "Retry-After.",
        default=64,
    )
    max_n: int = doc("Largest `n` (samples per request) a request may ask for.", default=16)
    request_timeout: float = doc(
        "Seconds one request may run; then it is aborted and answered with a timeout error.",
        default=600.0,
    )
    shutdown_timeout: float = doc(
        "On SIGTERM, seconds running requests get to finish before the server exits.",
        default=30.0,
    )
    max_body_bytes: int = doc(
        "Largest request body in bytes; a bigger one is answered 413 (base64 images count: "
        "raise it to send large ones).",
        default=MIB,
    )
    allow_local_images: bool = doc(
        "Vision-language models: also accept image_url parts that are paths (or file:// URLs) "
        "of files on the server's machine. Off by default: a client could otherwise make the "
        "server read its files. data: and http(s) URLs are always accepted.",
        default=False,
    )

    def __post_init__(self):
        check_fields(
            self,
            port=within(1, 65535),
            max_num_seqs=at_least(1),
            max_model_len=at_least(2),
            max_queued_requests=at_least(1),
            max_n=at_least(1),
            request_timeout=above(0),
            shutdown_timeout=at_least(0),
            max_body_bytes=at_least(1024),
        )
