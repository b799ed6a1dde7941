"""`swiftlm deploy` with response_format and tools, through the official `openai` client, on a
tiny random model whose ChatML template renders tools (Qwen2.5-style): the grammar, not the
model, makes the answers parse."""

import json

import httpx
import pytest

from conftest import build_tiny_llama, build_tokenizer
from tool_templates import TOOL_CHATML, openai_tool_row

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from serve_helpers import ServerThread  # noqa: E402

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
            },
        },
    },
]
ITEM = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "pattern": "^[a-z ]{1,10}$"},
        "done": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["title", "done", "tags"],
    "additionalProperties": False,
}


def build_app(model_dir):
    from swiftlm.engine.build import build_engine
    from swiftlm.serve.app import ServerSettings, generation_app
    from swiftlm.serve.translate import ServedModels

    engine = build_engine(str(model_dir), max_num_seqs=8, max_model_len=1024, seed=0)
    app = generation_app(engine, engine.tokenizer, ServedModels("tiny"), ServerSettings())
    return engine, app


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-llama-tools")
    tokenizer = build_tokenizer(out, chat_template=TOOL_CHATML)
    build_tiny_llama(out, vocab_size=len(tokenizer))
    engine, app = build_app(out)
    with ServerThread(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    engine.shutdown()


def test_json_schema_answers_validate_at_temperature_one(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM, "strict": True}}
    choices = [
        choice
        for seed in range(4)
        for choice in client.chat.completions.create(
            model="tiny", messages=MESSAGES, response_format=fmt, temperature=1.0, n=5, seed=seed
        ).choices
    ]
    assert len(choices) == 20
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), ITEM)


def test_json_object_answers_parse(client):
    answer = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format={"type": "json_object"},
        temperature=0.7,
        n=4,
        seed=3,
        max_tokens=300,
    )
    finished = [c for c in answer.choices if c.finish_reason == "stop"]
    assert finished
    for choice in finished:
        assert isinstance(json.loads(choice.message.content), dict)


def test_required_tool_choice_returns_a_call_whose_arguments_validate(client):
    answer = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", n=4, seed=4
    )
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"


def test_named_tool_choice_calls_that_function_and_streams_it_in_one_delta(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    answer = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, seed=5
    )
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, seed=5, stream=True
        )
    )
    deltas = [c.choices[0] for c in chunks if c.choices]
    called = [d for d in deltas if d.delta.tool_calls]
    assert len(called) == 1 and called[0].finish_reason == "tool_calls"
    assert called[0].delta.tool_calls[0].function.name == "get_time"


def test_history_with_tool_calls_and_tool_results_is_accepted(client):
    row = openai_tool_row()
    messages = [m for m in row["messages"] if m["role"] != "assistant" or m.get("tool_calls")]
    for message in messages:
        if message.get("tool_calls"):
            message["tool_calls"] = [{"id": "call_1", **c} for c in message["tool_calls"]]
        if message["role"] == "tool":
            message.setdefault("tool_call_id", "call_1")
    answer = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.bad_input(
    input="`swiftlm deploy`: tools with a model whose chat template does not render them; "
    "tool_choice naming no tool; response_format json_schema without a schema; "
    "response_format with a forced tool call",
    outcome="400 naming the field and the fix (serve a model whose template supports tools)",
)
def test_bad_structured_requests_are_400(client, tiny_model_dir):
    bad = [
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(tool_choice="required"),
        dict(response_format={"type": "json_schema"}),
        dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
    ]
    for fields in bad:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", messages=MESSAGES, **fields)
    # The plain ChatML template of the tiny model ignores tools.
    engine, app = build_app(tiny_model_dir)
    try:
        with ServerThread(app) as url:
            body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS}
            reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert reply.status_code == 400
            assert "does not render tools" in reply.json()["error"]["message"]
    finally:
        engine.shutdown()
