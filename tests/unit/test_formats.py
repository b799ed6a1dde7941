"""Format detection, normalization to canonical messages, and conversation checks."""

import pytest

from swiftlm.data.formats import RowError, check_conversation, to_messages, to_text
from swiftlm.data.parts import content_images, content_text, flatten_text_parts


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


def tool(text):
    return {"role": "tool", "content": text}


def calls(text, *functions):
    """A canonical assistant message with `text` and one tool call per function."""
    tool_calls = [{"type": "function", "function": function} for function in functions]
    return {"role": "assistant", "content": text, "tool_calls": tool_calls}


def expect_error(kind, fragment, record, **kwargs):
    with pytest.raises(RowError) as info:
        to_messages(record, **kwargs)
    assert info.value.kind == kind
    assert fragment in str(info.value)
    return str(info.value)


# --- each format -> exact messages ------------------------------------------------------


def test_messages_format_keeps_roles_and_the_per_message_loss():
    record = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi", "name": "ann"},
            {"role": "assistant", "content": "Hello", "loss": True},
        ]
    }
    answer = {**assistant("Hello"), "loss": True}
    assert to_messages(record) == [system("Be brief."), user("Hi"), answer]


def test_messages_format_maps_ms_swift_tool_roles():
    record = {
        "messages": [
            user("Weather?"),
            {"role": "tool_call", "content": '{"name": "weather"}'},
            {"role": "tool_response", "content": "sunny"},
            {"role": "function", "content": "warm"},
            assistant("Sunny and warm."),
        ]
    }
    assert to_messages(record) == [
        user("Weather?"),
        calls("", {"name": "weather", "arguments": {}}),
        tool("sunny"),
        tool("warm"),
        assistant("Sunny and warm."),
    ]


def test_sharegpt_from_value_with_top_level_system():
    record = {
        "system": "You are kind.",
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
            {"from": "human", "value": "Look it up"},
            {"from": "function_call", "value": '{"name": "search", "arguments": "{}"}'},
            {"from": "observation", "value": "found"},
            {"from": "gpt", "value": "Found it."},
        ],
    }
    assert to_messages(record) == [
        system("You are kind."),
        user("Hi"),
        assistant("Hello"),
        user("Look it up"),
        calls("", {"name": "search", "arguments": {}}),
        tool("found"),
        assistant("Found it."),
    ]


def test_sharegpt_with_role_content_keys():
    record = {"conversations": [user("Hi"), assistant("Hello")]}
    assert to_messages(record) == [user("Hi"), assistant("Hello")]


def test_alpaca_joins_instruction_and_input_and_expands_history():
    record = {
        "system": "Sys",
        "history": [["q1", "r1"]],
        "instruction": "Translate",
        "input": "bonjour",
        "output": "hello",
    }
    assert to_messages(record) == [
        system("Sys"),
        user("q1"),
        assistant("r1"),
        user("Translate\nbonjour"),
        assistant("hello"),
    ]


def test_alpaca_with_empty_or_null_input_and_system_uses_instruction_only():
    record = {"instruction": "Say hi", "input": "", "output": "hi", "system": None}
    assert to_messages(record) == [user("Say hi"), assistant("hi")]
    assert to_messages({"instruction": "Say hi", "input": None, "output": "hi"}) == [
        user("Say hi"),
        assistant("hi"),
    ]


def test_query_response_with_history_and_system():
    record = {
        "query": "q3",
        "response": "r3",
        "history": [["q1", "r1"], ["q2", "r2"]],
        "system": "S",
    }
    assert to_messages(record) == [
        system("S"),
        user("q1"),
        assistant("r1"),
        user("q2"),
        assistant("r2"),
        user("q3"),
        assistant("r3"),
    ]


def test_a_row_in_two_formats_is_refused_not_read_one_way():
    record = {"messages": [user("a"), assistant("b")], "query": "x", "response": "y"}
    message = expect_error("two layouts", "'messages' (role/content list) and 'query'", record)
    assert "keep one layout per row" in message


def test_null_messages_column_falls_through_to_next_format():
    record = {"messages": None, "conversations": None, "query": "x", "response": "y"}
    assert to_messages(record) == [user("x"), assistant("y")]


# --- each RowError kind -----------------------------------------------------------------


def test_no_recognizable_format_lists_found_keys():
    message = expect_error(
        "no recognizable format",
        "found keys ['answer', 'question']",
        {
            "question": "q",
            "answer": "a",
        },
    )
    assert "'instruction' + 'output' (Alpaca)" in message


def test_unknown_role_in_messages():
    message = expect_error(
        "unknown role",
        "unknown role 'bot' in message 2",
        {"messages": [user("hi"), {"role": "bot", "content": "x"}]},
    )
    assert message == "unknown role 'bot' in message 2; expected system, user, assistant or tool"


def test_unknown_role_in_sharegpt_lists_sharegpt_names():
    record = {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "x"}]}
    message = expect_error("unknown role", "unknown role 'bot' in message 2", record)
    assert message.endswith("expected human, gpt, system, tool, function or observation")


def test_empty_user_content():
    expect_error(
        "empty content",
        "empty content in user message 1",
        {"messages": [user("  \n"), assistant("x")]},
    )


def test_empty_assistant_answer_names_message_index():
    record = {"messages": [user("a"), assistant("b"), user("c"), assistant(" ")]}
    message = expect_error("empty assistant answer", "", record)
    assert message == "empty assistant answer in message 4"


def test_empty_alpaca_output_is_empty_assistant_answer():
    expect_error("empty assistant answer", "message 2", {"instruction": "x", "output": ""})


def test_two_user_messages_in_a_row_is_wrong_order():
    message = expect_error(
        "wrong role order", "", {"messages": [user("a"), user("b"), assistant("c")]}
    )
    assert message == "wrong role order: message 2 is 'user' after 'user'; expected 'assistant'"


def test_conversation_starting_with_assistant_is_wrong_order():
    message = expect_error("wrong role order", "", {"messages": [system("s"), assistant("a")]})
    assert message == "wrong role order: message 2 is 'assistant' at the start; expected 'user'"


def test_system_not_first_is_wrong_order():
    record = {"messages": [user("a"), assistant("b"), system("s"), user("c"), assistant("d")]}
    expect_error(
        "wrong role order", "message 3 is 'system'; a system message is only allowed first", record
    )


def test_tool_after_user_is_wrong_order():
    expect_error(
        "wrong role order",
        "message 2 is 'tool' after 'user'; expected 'assistant'",
        {"messages": [user("a"), tool("t"), assistant("b")]},
    )


def test_ending_with_user_is_no_answer():
    record = {"messages": [user("a"), assistant("b"), user("c")]}
    expect_error("no answer", "ends with a 'user' message (message 3)", record)


def test_ending_with_user_is_allowed_for_inference_prompts():
    record = {"messages": [system("s"), user("a"), assistant("b"), user("c")]}
    assert to_messages(record, require_answer=False) == [
        system("s"),
        user("a"),
        assistant("b"),
        user("c"),
    ]


def test_conversation_without_user_message():
    expect_error("empty content", "has no user message", {"messages": [system("s")]})
    expect_error("empty content", "has no user message", {"messages": []}, require_answer=False)


def test_non_string_content_is_bad_field_type():
    record = {"messages": [user("a"), {"role": "assistant", "content": None}]}
    message = expect_error("bad field type", "", record)
    assert message == "message 2 (assistant) 'content' must be a string, got null"


def test_messages_not_a_list_is_bad_field_type():
    expect_error("bad field type", "'messages' must be a list, got str", {"messages": "hi"})


def test_message_not_an_object_is_bad_field_type():
    expect_error("bad field type", "message 1 is list", {"messages": [["user", "hi"]]})


def test_bad_history_is_bad_field_type():
    record = {"query": "q", "response": "r", "history": [["only one"]]}
    expect_error("bad field type", "'history' item 1 must be a [query, response] pair", record)
    record = {"query": "q", "response": "r", "history": "q1 r1"}
    expect_error("bad field type", "'history' must be a list", record)


def test_non_string_output_is_bad_field_type():
    expect_error(
        "bad field type", "'output' must be a string, got int", {"instruction": "x", "output": 4}
    )


def test_check_conversation_accepts_tool_round_trip():
    messages = [user("a"), assistant("call"), tool("r1"), tool("r2"), assistant("done")]
    assert check_conversation(messages) is None


def test_check_conversation_rejects_non_canonical_role():
    with pytest.raises(RowError) as info:
        check_conversation([{"role": "human", "content": "hi"}, assistant("x")])
    assert info.value.kind == "unknown role"


# --- pre-training text ------------------------------------------------------------------


def test_to_text_returns_text_field_unchanged():
    assert to_text({"text": "  A document.\n", "meta": 1}) == "  A document.\n"


def test_to_text_joins_chat_contents_with_blank_lines():
    record = {"messages": [system("S"), user("Q"), assistant("A")]}
    assert to_text(record) == "S\n\nQ\n\nA"
    assert to_text({"instruction": "I", "input": "x", "output": "O"}) == "I\nx\n\nO"


def test_to_text_errors():
    with pytest.raises(RowError) as info:
        to_text({"text": " \n "})
    assert info.value.kind == "empty text"
    with pytest.raises(RowError) as info:
        to_text({"content": "x"})
    assert info.value.kind == "no recognizable format"
    assert "found keys ['content']; expected 'text' or a chat format" in str(info.value)
    with pytest.raises(RowError) as info:
        to_text({"text": 3})
    assert (info.value.kind, str(info.value)) == (
        "bad field type",
        "'text' must be a string, got int",
    )


def test_inference_prompts_may_omit_the_answer_field():
    assert to_messages({"query": "Hi?"}, require_answer=False) == [
        {"role": "user", "content": "Hi?"}
    ]
    assert to_messages({"instruction": "Sum", "input": "1 2"}, require_answer=False) == [
        {"role": "user", "content": "Sum\n1 2"}
    ]
    with pytest.raises(RowError) as error:
        to_messages({"query": "Hi?"})
    assert error.value.kind == "no recognizable format"


# --- content parts ----------------------------------------------------------------------


def text_part(text):
    return {"type": "text", "text": text}


def image_part(ref):
    return {"type": "image", "image": ref}


TEXT_EXAMPLE = '{"type": "text", "text": "..."}'


def test_content_parts_in_every_spelling_normalize_to_one_form():
    parts = [
        {"type": "text", "text": "Compare ", "cache_control": {}},
        {"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "low"}},
        {"type": "image_url", "image_url": "b.png"},
        {"type": "image", "image": "c.png"},
        {"type": "text", "text": "please."},
    ]
    record = {"messages": [{"role": "user", "content": parts}, assistant("Same.")]}
    content = to_messages(record)[0]["content"]
    assert content == [
        text_part("Compare "),
        image_part("https://x/a.png"),
        image_part("b.png"),
        image_part("c.png"),
        text_part("please."),
    ]
    assert content_text(content) == "Compare please."
    assert content_images(content) == ["https://x/a.png", "b.png", "c.png"]
    # Canonical messages are valid input again.
    assert to_messages({"messages": to_messages(record)}) == to_messages(record)
    assert content_text(" as is ") == " as is "
    assert content_images("<image> is just text") == []
    assert content_text([]) == "" and content_images([]) == []


def test_sharegpt_values_may_be_part_lists_and_images_alone_are_content():
    picture = [image_part("x.png")]
    record = {"conversations": [{"from": "human", "value": picture}, {"from": "gpt", "value": "A"}]}
    assert to_messages(record) == [{"role": "user", "content": picture}, assistant("A")]


def test_empty_part_lists_are_empty_content():
    record = {"messages": [{"role": "user", "content": []}, assistant("x")]}
    expect_error("empty content", "empty content in user message 1", record)
    blank = {"role": "assistant", "content": [text_part(" "), text_part("\n")]}
    message = expect_error("empty assistant answer", "", {"messages": [user("q"), blank]})
    assert message == "empty assistant answer in message 2"


OF_A_TYPE = "expected an object of type 'text', 'image_url' or 'image', e.g. " + TEXT_EXAMPLE
IMAGE_URL_EXAMPLE = '{"type": "image_url", "image_url": {"url": "cat.png"}}'


@pytest.mark.parametrize(
    ("part", "problem"),
    [
        ({"type": "audio", "audio": "a.wav"}, f"has unknown type 'audio'; {OF_A_TYPE}"),
        ({"text": "no type"}, f"has no 'type'; {OF_A_TYPE}"),
        ("plain string", f"is str; {OF_A_TYPE}"),
        (
            {"type": "text", "content": "x"},
            f"has no string 'text' (got null); write {TEXT_EXAMPLE}",
        ),
        (
            {"type": "image_url", "image_url": {"uri": "x.png"}},
            f"needs a string 'image_url.url' (got null); write {IMAGE_URL_EXAMPLE}",
        ),
        (
            {"type": "image_url", "image_url": 7},
            f"needs a string 'image_url' (got int); write {IMAGE_URL_EXAMPLE}",
        ),
        (
            {"type": "image", "image": ["x.png"]},
            'needs a string \'image\' (got list); write {"type": "image", "image": "cat.png"}',
        ),
        ({"type": "image", "image": " "}, "has an empty 'image'; give an image path or URL"),
    ],
)
def test_bad_content_parts_name_the_part_and_the_fix(part, problem):
    record = {"messages": [{"role": "user", "content": [text_part("Look:"), part]}, assistant("a")]}
    message = expect_error("bad content part", "", record)
    assert message == f"message 1 (user) content part 2 {problem}"


def test_content_of_another_type_is_bad_field_type():
    record = {"messages": [{"role": "user", "content": {"type": "text"}}, assistant("a")]}
    message = expect_error("bad field type", "", record)
    assert (
        message
        == "message 1 (user) 'content' must be a string or a list of content parts, got dict"
    )


def test_flatten_text_parts_keeps_strings_and_images():
    messages = [
        user("plain"),
        {"role": "user", "content": [text_part("a"), text_part("b")]},
        {"role": "user", "content": [text_part("c"), image_part("x.png")]},
    ]
    assert flatten_text_parts(messages) == [
        user("plain"),
        user("ab"),
        {"role": "user", "content": [text_part("c"), image_part("x.png")]},
    ]
    assert messages[1]["content"] == [text_part("a"), text_part("b")]  # input untouched


def test_to_text_uses_the_text_of_part_lists():
    record = {
        "messages": [
            {"role": "user", "content": [text_part("Q"), text_part("?")]},
            assistant("A"),
        ]
    }
    assert to_text(record) == "Q?\n\nA"
