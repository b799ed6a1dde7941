"""The Hermes tool-call parser and the schema of a forced call: 0, 1 and 2 calls, text around
them, and malformed calls left in the content instead of crashing or vanishing."""

import json

import pytest

pytest.importorskip("fastapi")

from swiftlm.serve.structured import call_schema  # noqa: E402
from swiftlm.serve.tools import TOOL_PARSERS, parse_hermes, tool_message  # noqa: E402

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_plain_text_has_no_calls():
    assert parse_hermes("Sunny in Paris.") == ("Sunny in Paris.", [])
    message, called = tool_message("Sunny in Paris.")
    assert not called and message == {"role": "assistant", "content": "Sunny in Paris."}


def test_one_call_becomes_an_openai_tool_call_with_json_text_arguments():
    message, called = tool_message(CALL)
    assert called and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_two_calls_and_the_text_around_them():
    other = CALL.replace("get_weather", "get_time").replace('"city": "Paris"', '"zone": "UTC"')
    content, calls = parse_hermes(f"Let me check.\n{CALL}\n{other}")
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "UTC"}),
    ]


@pytest.mark.bad_input(
    input="`swiftlm deploy` with tools: the model writes a <tool_call> whose JSON does not parse "
    "or has no name",
    outcome="The block stays in message.content (finish_reason stop); well-formed calls beside "
    "it are still returned",
)
def test_malformed_calls_stay_in_the_content():
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    nameless = '<tool_call>{"arguments": {}}</tool_call>'
    content, calls = parse_hermes(f"{broken} {nameless}")
    assert calls == [] and content == f"{broken} {nameless}"
    content, calls = parse_hermes(f"{broken}\n{CALL}")
    assert content == broken and [c.name for c in calls] == ["get_weather"]
    assert tool_message(broken) == ({"role": "assistant", "content": broken}, False)


def test_arguments_as_json_text_are_decoded_and_hermes_is_registered():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert parse_hermes(text)[1][0].arguments == {"x": 1}
    assert TOOL_PARSERS["hermes"] is parse_hermes


def test_forced_call_schema_names_one_function_or_any_of_several():
    one = call_schema([{"name": "f", "parameters": {"type": "object"}}])
    assert one["properties"]["name"] == {"const": "f"}
    several = call_schema([{"name": "f"}, {"name": "g"}])
    assert [o["properties"]["name"]["const"] for o in several["anyOf"]] == ["f", "g"]
