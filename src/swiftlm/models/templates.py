"""The chat template used when a tokenizer has none.

It is ChatML (`<|im_start|>role\\ncontent<end>\\n`) where `<end>` is the tokenizer's own EOS
token, so a base model learns to stop on a token it already has and no embedding rows are
added. When the tokenizer has a real `<|im_end|>` token, that is used instead.
"""

# Chat templates added by plugins (swiftlm.plugins.register_chat_template): Hugging Face
# model_type -> Jinja template, used instead of the tokenizer's own for models of that type.
CHAT_TEMPLATES: dict[str, str] = {}

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + END_OF_TURN + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chatml_template(end_of_turn: str) -> str:
    quoted = "'" + end_of_turn.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return CHATML_TEMPLATE.replace("END_OF_TURN", quoted)


def has_token(tokenizer, token: str) -> bool:
    """Whether `token` is one vocabulary entry (without building the whole vocab dict, which
    takes milliseconds for a 50k vocabulary)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    return token_id is not None and token_id != tokenizer.unk_token_id


def end_of_turn_token(tokenizer) -> str:
    """The token that closes an assistant turn (what generation stops on)."""
    template = tokenizer.chat_template or ""
    for candidate in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        if candidate in template and has_token(tokenizer, candidate):
            return candidate
    return tokenizer.eos_token


def ensure_chat_template(tokenizer, model_type: str | None = None) -> None:
    """Give a tokenizer the template a plugin registered for `model_type`, else, without a
    chat template, the documented ChatML default."""
    if model_type in CHAT_TEMPLATES:
        tokenizer.chat_template = CHAT_TEMPLATES[model_type]
        return
    if tokenizer.chat_template:
        return
    if tokenizer.eos_token is None:
        raise ValueError("the tokenizer has neither a chat template nor an EOS token")
    end = "<|im_end|>" if has_token(tokenizer, "<|im_end|>") else tokenizer.eos_token
    tokenizer.chat_template = chatml_template(end)
