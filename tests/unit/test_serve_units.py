"""Pure parts of the server: API keys, error messages, request checks."""

import pytest

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
        (chat(n=17), 10, "n"),
        (chat(top_p=0), 10, "top_p"),
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
