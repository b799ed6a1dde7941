"""OpenAI requests -> engine requests: the model name, the prompt's token ids, the sampling.

Every check that depends on the request alone happens here, before anything reaches the
engine, and fails with a 4xx `APIError` naming the field.
"""

from dataclasses import dataclass

from swiftlm.engine.protocol import SamplingParams
from swiftlm.serve.errors import APIError
from swiftlm.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    Prompt,
    SamplingFields,
)
from swiftlm.serve.tools import check_renders_tools, template_message, template_tools


@dataclass(frozen=True)
class ServedModels:
    """The names clients use: the base model's, and one per adapter."""

    base: str
    adapters: tuple[str, ...] = ()

    def names(self) -> list[str]:
        return [self.base, *self.adapters]

    def adapter_for(self, name: str) -> str | None:
        """The adapter a request's `model` selects (None: the base); 404 for unknown names."""
        if name == self.base:
            return None
        if name in self.adapters:
            return name
        raise APIError(
            404,
            f"The model '{name}' does not exist; served models: {', '.join(self.names())}",
            param="model",
            code="model_not_found",
        )


def reject_unsupported(request: SamplingFields) -> None:
    unsupported = request.unsupported_field()
    if unsupported:
        field, reason = unsupported
        raise APIError(400, f"'{field}': {reason}", param=field, code="unsupported_field")


def chat_prompt_ids(tokenizer, request: ChatCompletionRequest, system: str | None) -> list[int]:
    """The conversation (and its tools) rendered by the tokenizer's chat template, ready for
    the answer; 400 when the request has tools and the template would not show them."""
    messages = [template_message(m) for m in request.messages]
    if system is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    tools = template_tools(request)

    def render(with_tools: list[dict] | None) -> str:
        extra = {"tools": with_tools} if with_tools else {}
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **extra
        )

    try:
        text = render(tools)
        if tools:
            check_renders_tools(render, tools)
    except APIError:
        raise
    except Exception as exc:  # a template may raise on roles or orders it does not accept
        raise APIError(
            400, f"'messages': the model's chat template refused them: {exc}", param="messages"
        ) from None
    # The template writes the special tokens (BOS included) itself.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def completion_prompts(tokenizer, request: CompletionRequest) -> list[list[int]]:
    """The token ids of each of the request's prompts (text is tokenized, token ids are
    checked against the vocabulary); 400 naming the prompt that cannot run."""
    prompts = request.prompts()
    listed = prompts[0] is not request.prompt  # a list of prompts: each named by its index
    return [
        completion_prompt_ids(tokenizer, prompt, f"prompt[{i}]" if listed else "prompt")
        for i, prompt in enumerate(prompts)
    ]


def completion_prompt_ids(tokenizer, prompt: Prompt, where: str = "prompt") -> list[int]:
    param = where.replace("[", ".").replace("]", "")
    if not prompt:
        raise APIError(400, f"'{where}' must not be empty", param=param)
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    # Ids past the tokenizer's vocabulary would index past the model's embeddings (or into
    # rows no token trained): the client tokenized with another model's tokenizer.
    vocab = len(tokenizer)
    for i, token in enumerate(prompt):
        if token >= vocab:
            raise APIError(
                400,
                f"'{where}[{i}]' is token id {token}, outside this model's vocabulary of "
                f"{vocab} tokens (ids 0 to {vocab - 1}); tokenize with the served model's "
                "tokenizer",
                param=f"{param}.{i}",
                code="invalid_value",
            )
    return list(prompt)


def check_sample_count(prompts: int, n: int, max_n: int) -> None:
    """A completion request's samples (its prompts times n) fit --max_n: a list of many
    prompts must not take the whole engine, as a large n may not."""
    if prompts * n <= max_n:
        return
    if prompts == 1:
        message = f"'n' is {n}; this server answers at most {max_n} samples per request (--max_n)"
        raise APIError(400, message, param="n", code="invalid_value")
    raise APIError(
        400,
        f"'prompt' holds {prompts} prompts and 'n' is {n}: {prompts * n} samples, and this "
        f"server answers at most {max_n} per request (--max_n); send the prompts in several "
        "requests",
        param="prompt",
        code="invalid_value",
    )


def sampling_params(
    request: ChatCompletionRequest | CompletionRequest,
    prompt_tokens: int,
    max_model_len: int,
    max_n: int,
) -> SamplingParams:
    """The engine's sampling for `request`; 400 for a bad value or a prompt that leaves no room."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_tokens}, leaving no room for an answer. Shorten the prompt",
            param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    budget = request.token_budget()
    if budget is not None and budget > room:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_tokens} and max_tokens asks for {budget} more. Lower max_tokens to at "
            f"most {room}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    stop = request.stop_strings()
    if any(not s for s in stop):  # the schema checks the types and the count
        raise APIError(400, "'stop' strings must not be empty", param="stop")
    logprobs, top_logprobs = _logprobs(request)
    params = SamplingParams(
        max_tokens=room if budget is None else budget,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        stop=stop,
        ignore_eos=request.ignore_eos,
        seed=request.seed,
        n=request.n,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    problem = params.check(max_n=max_n)
    if problem:
        field = problem.split()[0]
        param = "max_tokens" if field == "max_tokens" else field
        raise APIError(400, problem, param=param, code="invalid_value")
    return params


def _logprobs(request: ChatCompletionRequest | CompletionRequest) -> tuple[bool, int]:
    """(logprobs wanted, alternatives per token): chat says `logprobs: true, top_logprobs: k`,
    completions say `logprobs: k`."""
    if isinstance(request, CompletionRequest):
        if request.logprobs is None:
            return False, 0
        return True, request.logprobs  # the schema checks its range
    return request.logprobs, request.top_logprobs or 0
