"""Tool-calling rows: normalized to canonical calls, rendered with the chat template's tools,
the calls trained and the tool results not; templates without tool support are refused."""

import json

import pytest

from conftest import build_tokenizer
from swiftlm.data.encode import IGNORE_INDEX, encode_chat, encode_chat_samples
from swiftlm.data.formats import RowError, chat_sample, to_messages
from swiftlm.data.tools import CALL_EXAMPLE, parse_tools
from swiftlm.errors import DataError
from tool_templates import TOOL_CHATML, WEATHER_TOOL, openai_tool_row


def call(city: str, **extra) -> dict:
    return {
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": city}},
        **extra,
    }


def label_texts(tokenizer, encoded: dict) -> list[str]:
    """The decoded runs of labelled tokens."""
    runs, current = [], []
    for label in [*encoded["labels"], IGNORE_INDEX]:
        if label != IGNORE_INDEX:
            current.append(label)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


@pytest.fixture
def tool_tokenizer(tmp_path):
    return build_tokenizer(tmp_path, chat_template=TOOL_CHATML)


MS_SWIFT_AGENT_ROW = {
    # ms-swift stores tools as a JSON string; this one is a bare function schema.
    "tools": json.dumps([WEATHER_TOOL["function"]]),
    "messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Let me check."},
        {"role": "tool_call", "content": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
        {"role": "tool_call", "content": '{"name": "get_weather", "arguments": {"city": "Rome"}}'},
        {"role": "tool_response", "content": "sunny"},
        {"role": "tool_response", "content": "rainy"},
        {"role": "assistant", "content": "Sunny in Paris, rainy in Rome."},
    ],
}


@pytest.mark.bad_input(
    input="An OpenAI-format assistant message with tool_calls and null content, with a tools list",
    outcome="Kept as a tool call (arguments parsed to an object) with the row's tools",
)
def test_openai_tool_calls_with_null_content_are_kept_as_calls():
    sample = chat_sample(openai_tool_row())
    assert sample == {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call("Paris", id="c1")]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
            {"role": "assistant", "content": "Sunny in Paris."},
        ],
        "tools": [WEATHER_TOOL],
    }


@pytest.mark.bad_input(
    input="An ms-swift agent row: tools as a JSON string, tool_call and tool_response messages",
    outcome="The assistant text and its tool_call messages become one turn with the calls",
)
def test_ms_swift_agent_row_merges_its_calls_into_the_assistant_turn():
    sample = chat_sample(MS_SWIFT_AGENT_ROW)
    assert sample["tools"] == [WEATHER_TOOL]
    assert sample["messages"] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [call("Paris"), call("Rome")],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rainy"},
        {"role": "assistant", "content": "Sunny in Paris, rainy in Rome."},
    ]


def test_call_content_may_be_an_already_parsed_object():
    # Parquet and hub datasets may hold the call as a struct rather than its JSON text.
    content = {"name": "get_weather", "arguments": {"city": "Paris"}}
    messages = to_messages(row_with({"role": "tool_call", "content": content}))
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [call("Paris")]}


def test_empty_tools_and_calls_mean_none():
    assert parse_tools("") is None and parse_tools([]) is None and parse_tools(None) is None
    assert "tools" not in chat_sample({**openai_tool_row(), "tools": []})
    answer = {"role": "assistant", "content": "Sunny.", "tool_calls": []}
    assert to_messages(row_with(answer))[1] == {"role": "assistant", "content": "Sunny."}


def row_with(message: dict) -> dict:
    return {"messages": [{"role": "user", "content": "Weather?"}, message]}


BAD_CALLS = [
    (
        row_with({"role": "tool_call", "content": "get_weather(Paris)"}),
        "message 2 (tool_call) content: not valid JSON (Expecting value at column 1); "
        f"write {CALL_EXAMPLE}",
    ),
    (
        row_with(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": '}}],
            }
        ),
        "message 2 (assistant) tool call 1 arguments: not valid JSON (Expecting value at "
        'column 10); write {"city": "Paris"}',
    ),
    (
        row_with({"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]}),
        f"message 2 (assistant) tool call 1 has no function name; write {CALL_EXAMPLE}",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "Hi", "tool_calls": [call("Paris")]},
                {"role": "assistant", "content": "Hello"},
            ]
        },
        "message 1 (user) has 'tool_calls'; only assistant messages call tools",
    ),
]


@pytest.mark.bad_input(
    input="A malformed tool call (not JSON, no function name, or on a user message)",
    outcome="The row is refused (file:line) naming the message and call, with an example",
)
@pytest.mark.parametrize("record, message", BAD_CALLS)
def test_malformed_tool_calls_name_the_message_and_the_fix(record, message):
    with pytest.raises(RowError) as info:
        to_messages(record)
    assert (info.value.kind, str(info.value)) == ("bad tool call", message)


def test_tools_that_are_not_a_list_name_the_fix():
    with pytest.raises(RowError) as info:
        chat_sample({**openai_tool_row(), "tools": {"name": "get_weather"}})
    assert str(info.value).startswith("'tools' must be a list of tools, got dict; write [{")


@pytest.mark.bad_input(
    input="Tool-calling rows on a model whose chat template supports tools",
    outcome="Rendered with the template's tools; the calls are training targets, results are not",
)
def test_tool_calls_are_training_targets_and_tool_results_are_not(tool_tokenizer):
    sample = chat_sample(MS_SWIFT_AGENT_ROW)
    encoded = encode_chat(tool_tokenizer, sample["messages"], "assistant", tools=sample["tools"])
    text = tool_tokenizer.decode(encoded["input_ids"])
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert label_texts(tool_tokenizer, encoded) == [
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>',
        "Sunny in Paris, rainy in Rome.<|im_end|>",
    ]


def test_openai_row_trains_the_call_with_null_content(tool_tokenizer):
    sample = {**chat_sample(openai_tool_row()), "source": "agent.jsonl:1"}
    encoded, _ = encode_chat_samples(tool_tokenizer, [sample], 1000, "delete", "assistant")
    assert label_texts(tool_tokenizer, encoded[0]) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>",
        "Sunny in Paris.<|im_end|>",
    ]


@pytest.mark.bad_input(
    input="A row with a tools list, on a model whose chat template ignores tools",
    outcome="Refused naming file:line: the template does not render tools; use a model "
    "whose template does",
)
def test_template_without_tools_support_is_refused_naming_the_row(tiny_tokenizer):
    sample = {**chat_sample(openai_tool_row()), "source": "agent.jsonl:3"}
    with pytest.raises(DataError) as info:
        encode_chat_samples(tiny_tokenizer, [sample], 1000, "delete", "assistant")
    assert str(info.value) == (
        "agent.jsonl:3: the row has a 'tools' list, but this model's chat template does not "
        "render tools (the text is the same with and without them); use a model whose chat "
        "template supports tools, e.g. Qwen2.5-Instruct (swiftlm renders every row with the "
        "model's own chat template), or remove the 'tools' column"
    )


@pytest.mark.bad_input(
    input="An assistant tool call on a model whose chat template drops tool_calls",
    outcome="Refused naming file:line and the called function; use a model whose template "
    "renders calls",
)
def test_template_that_drops_tool_calls_is_refused_naming_the_call(tiny_tokenizer):
    record = {key: value for key, value in openai_tool_row().items() if key != "tools"}
    sample = {**chat_sample(record), "source": "agent.jsonl:4"}
    with pytest.raises(DataError) as info:
        encode_chat_samples(tiny_tokenizer, [sample], 1000, "delete", "all")
    assert str(info.value) == (
        "agent.jsonl:4: the assistant turn calling 'get_weather' loses its call in this model's "
        "chat template (the text is the same with and without it), so the call would not be "
        "trained; use a model whose chat template supports tools, e.g. Qwen2.5-Instruct "
        "(swiftlm renders every row with the model's own chat template)"
    )
