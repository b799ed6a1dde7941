"""Pure parts of the server: API keys, error messages, request checks."""

import pytest
from pydantic import ValidationError

pytest.importorskip("fastapi")

from swiftlm.serve.auth import bearer_token, key_is_valid  # noqa: E402
from swiftlm.serve.errors import APIError, describe_validation_error  # noqa: E402
from swiftlm.serve.schemas import ChatCompletionRequest, CompletionRequest  # noqa: E402
from swiftlm.serve.translate import ServedModels, sampling_params  # noqa: E402


def test_bearer_token_and_keys():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("abc") is None and bearer_token("Basic abc") is None
    assert bearer_token(None) is None and bearer_token("Bearer ") is None
    keys = ("first", "second")
    assert key_is_valid("second", keys) and not key_is_valid("secon", keys)
    assert not key_is_valid(None, keys) and not key_is_valid("x", ())


def test_validation_errors_name_the_field():
    extra = [{"type": "extra_forbidden", "loc": ("body", "max_token"), "msg": "x"}]
    assert describe_validation_error(extra) == (
        "unknown field 'max_token': it is not part of this API",
        "max_token",
    )
    wrong = [{"type": "int_parsing", "loc": ("body", "n"), "msg": "Input should be an integer"}]
    assert describe_validation_error(wrong) == ("'n': Input should be an integer", "n")
    missing = [{"type": "missing", "loc": ("body", "messages"), "msg": "Field required"}]
    assert describe_validation_error(missing)[0] == "'messages' is required"


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **fields)


def test_unsupported_fields_are_named_and_best_of_n_is_allowed():
    # Chat supports tools and response_format; completions do not.
    assert chat(tools=[], response_format={"type": "text"}).unsupported_field() is None
    completion = CompletionRequest(model="m", prompt="x", tools=[])
    assert completion.unsupported_field()[0] == "tools"
    assert chat(parallel_tool_calls=True).unsupported_field()[0] == "parallel_tool_calls"
    assert chat(user="someone").unsupported_field() is None
    assert CompletionRequest(model="m", prompt="x", n=2, best_of=2).unsupported_field() is None
    assert CompletionRequest(model="m", prompt="x", best_of=3).unsupported_field()[0] == "best_of"


def test_sampling_params_fill_the_context_and_refuse_what_does_not_fit():
    assert sampling_params(chat(), 10, 100, 16).max_tokens == 90  # no max_tokens: the rest
    assert (
        sampling_params(chat(max_completion_tokens=5, max_tokens=50), 10, 100, 16).max_tokens == 5
    )
    completion = sampling_params(CompletionRequest(model="m", prompt="x", logprobs=3), 1, 9, 16)
    assert completion.logprobs and completion.top_logprobs == 3
    for request, prompt_tokens, param in [
        (chat(), 100, "messages"),
        (chat(max_tokens=91), 10, "max_tokens"),
        (chat(n=17), 10, "n"),  # the schema allows OpenAI's 128; the server's --max_n 16 not
        (chat(stop=[""]), 10, "stop"),
    ]:
        with pytest.raises(APIError) as info:
            sampling_params(request, prompt_tokens, 100, 16)
        assert info.value.status == 400 and info.value.param == param


def test_unknown_models_are_404_model_not_found():
    served = ServedModels("base", ("tuned",))
    assert served.adapter_for("base") is None and served.adapter_for("tuned") == "tuned"
    with pytest.raises(APIError) as info:
        served.adapter_for("gpt-4")
    assert (info.value.status, info.value.code) == (404, "model_not_found")
    assert "base, tuned" in info.value.message


def refusal(model, **fields) -> tuple[str, str | None]:
    """(message, param) of the 400 the server sends for a body with `fields`."""
    base = {"model": "m"}
    base |= (
        {"messages": [{"role": "user", "content": "x"}]} if model is ChatCompletionRequest else {}
    )
    base |= {"prompt": "x"} if model is CompletionRequest else {}
    with pytest.raises(ValidationError) as info:
        model.model_validate(base | fields)
    return describe_validation_error(info.value.errors())


@pytest.mark.bad_input(
    input='`swiftlm deploy`: a field of the wrong JSON type (`"stream": "yes"`, `"n": "2"`, '
    '`"max_tokens": 5.5` or `"5"`), or a sampling value out of OpenAI\'s range (seed past 64 '
    "bits, a penalty past ±2, temperature past 2, top_logprobs past 20, 5 stop strings, a "
    "logit_bias value past ±100)",
    outcome="400 naming the field and the type or range it must have; nothing is coerced "
    "(an integer is still a valid number)",
)
def test_fields_are_typed_strictly_and_range_checked_as_openai_does():
    assert refusal(ChatCompletionRequest, stream="yes") == (
        "'stream': Input should be a valid boolean",
        "stream",
    )
    for value in ("2", 2.0, True):
        assert refusal(ChatCompletionRequest, n=value)[1] == "n"
    for value in (5.5, "5"):
        assert refusal(CompletionRequest, max_tokens=value)[0] == (
            "'max_tokens': Input should be a valid integer"
        )
    assert chat(temperature=1, top_p=1, presence_penalty=-2).temperature == 1.0
    out_of_range = {
        "seed": 2**80,
        "presence_penalty": 2.5,
        "frequency_penalty": -3,
        "temperature": 2.1,
        "top_p": 0,
        "top_k": -1,
        "min_p": 1.5,
        "repetition_penalty": 0,
        "n": 0,
        "max_tokens": 0,
        "max_completion_tokens": 2**80,
        "top_logprobs": 21,
    }
    for field, value in out_of_range.items():
        message, param = refusal(ChatCompletionRequest, **{field: value})
        assert param == field and message.startswith(f"'{field}': Input should be"), message
    assert refusal(CompletionRequest, logprobs=21)[1] == "logprobs"
    assert refusal(ChatCompletionRequest, temperature=float("nan"))[0] == (
        "'temperature': Input should be a finite number"
    )
    assert refusal(ChatCompletionRequest, stop=["a"] * 5)[1] == "stop"
    assert refusal(ChatCompletionRequest, stop=7)[0] == (
        "'stop' must be a string or a list of at most 4 strings"
    )
    assert refusal(ChatCompletionRequest, logit_bias={"12": 101})[1] == "logit_bias.12"
    message, _ = refusal(ChatCompletionRequest, logit_bias={"hello": 1})
    assert message.startswith("'logit_bias' keys must be token ids") and "'hello'" in message


@pytest.mark.bad_input(
    input="`swiftlm deploy`: a chat message whose content is null (or missing) without "
    "tool_calls, content of another type, or text with an unpaired surrogate (`\\ud800`)",
    outcome="400 naming `messages[i].content` and the forms it may take",
)
def test_message_content_is_required_unless_the_assistant_called_tools():
    for message in ({"role": "user", "content": None}, {"role": "tool", "tool_call_id": "a"}):
        assert refusal(ChatCompletionRequest, messages=[message]) == (
            "'messages[0].content' is null; give the message's text (only an assistant "
            "message with tool_calls may leave content out)",
            "messages.0.content",
        )
    call = {"id": "c1", "function": {"name": "f", "arguments": "{}"}}
    called = {"role": "assistant", "tool_calls": [call]}
    assert ChatCompletionRequest(model="m", messages=[called]).messages[0].text() == ""
    message, param = refusal(ChatCompletionRequest, messages=[{"role": "user", "content": 5}])
    assert param == "messages.0.content" and message.startswith(
        "'messages[0].content' must be a string, a list of content parts"
    )
    # An unpaired surrogate (JSON's "\ud800") is no text: tokenizers raise on it.
    message, param = refusal(
        ChatCompletionRequest, messages=[{"role": "user", "content": "\ud800"}]
    )
    assert param == "messages.0.content" and "unpaired UTF-16 surrogate" in message
    parts = [{"type": "text", "text": "a"}, {"type": "video"}]
    message, param = refusal(ChatCompletionRequest, messages=[{"role": "user", "content": parts}])
    assert param == "messages.0.content.1" and "must be a content part" in message


@pytest.mark.bad_input(
    input="`swiftlm deploy`: a /v1/completions prompt of no accepted form (a number, an "
    'empty list, a mixed list such as [1, 2, "x"], a negative token id)',
    outcome="400 naming the element (`prompt[2]`) and listing the accepted forms: a string, "
    "a list of strings, a list of token ids, a list of token-id lists",
)
def test_a_prompt_of_no_accepted_form_is_named_by_its_element():
    forms = (
        "'prompt' must be a string, a list of strings, a list of token ids (integers of at "
        "least 0) or a list of token-id lists"
    )
    cases = {
        "'prompt[2]' is a string in a list of token ids": [1, 2, "x"],
        "'prompt[1]' is an integer in a list of strings": ["a", 1],
        "'prompt[1][1]' is a negative integer in a list of token ids": [[1], [2, -1]],
        "'prompt[0]' is a boolean at the start of a list": [True],
        "'prompt' is an empty list": [],
        "'prompt' is a number": 1.5,
    }
    for expected, prompt in cases.items():
        message, param = refusal(CompletionRequest, prompt=prompt)
        assert message == f"{expected}; {forms}" and param.startswith("prompt"), message
    assert CompletionRequest(model="m", prompt=[5, 6]).prompts() == [[5, 6]]
    assert CompletionRequest(model="m", prompt=[[5], [6]]).prompts() == [[5], [6]]
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompts() == ["a", "b"]
