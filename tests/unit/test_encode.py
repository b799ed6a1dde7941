"""Chat encoding: the label spans are exactly the assistant answers plus the end-of-turn token."""

import pytest

from conftest import build_tokenizer
from swiftlm.data.encode import (
    IGNORE_INDEX,
    TruncationReport,
    encode_chat,
    encode_chat_samples,
    encode_pretraining,
    truncate,
)
from swiftlm.errors import DataError
from swiftlm.models.templates import ensure_chat_template

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Who are you?"},
    {"role": "assistant", "content": "I am a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
]

# SmolLM2's own template: it injects a default system prompt when there is none.
SMOLLM_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def label_spans(encoded: dict) -> list[list[int]]:
    """Contiguous runs of labelled token ids."""
    spans, current = [], []
    for label in encoded["labels"]:
        if label == IGNORE_INDEX:
            if current:
                spans.append(current)
            current = []
        else:
            current.append(label)
    return spans + ([current] if current else [])


def test_assistant_spans_are_exactly_answers_plus_end_of_turn(tiny_tokenizer):
    encoded = encode_chat(tiny_tokenizer, CONVERSATION, "assistant")
    decoded = [tiny_tokenizer.decode(span) for span in label_spans(encoded)]
    assert decoded == [
        "I am a helpful assistant.<|im_end|>",
        "The capital of France is Paris.<|im_end|>",
    ]
    assert len(encoded["input_ids"]) == len(encoded["labels"])


def test_last_turn_scope_keeps_only_the_final_answer(tiny_tokenizer):
    encoded = encode_chat(tiny_tokenizer, CONVERSATION, "last_turn")
    decoded = [tiny_tokenizer.decode(span) for span in label_spans(encoded)]
    assert decoded == ["The capital of France is Paris.<|im_end|>"]


def test_all_scope_labels_every_token(tiny_tokenizer):
    encoded = encode_chat(tiny_tokenizer, CONVERSATION, "all")
    assert encoded["labels"] == encoded["input_ids"]


def test_template_with_injected_system_prompt(tmp_path):
    tokenizer = build_tokenizer(tmp_path, chat_template=SMOLLM_TEMPLATE)
    encoded = encode_chat(tokenizer, CONVERSATION[1:3], "assistant")
    assert [tokenizer.decode(s) for s in label_spans(encoded)] == [
        "I am a helpful assistant.<|im_end|>"
    ]
    assert "named SmolLM" in tokenizer.decode(encoded["input_ids"])


def test_default_chatml_template_ends_turns_with_eos(tmp_path):
    tokenizer = build_tokenizer(tmp_path, chat_template=None)
    tokenizer.chat_template = None
    tokenizer.eos_token = "<|endoftext|>"
    ensure_chat_template(tokenizer)
    # The tokenizer has a real <|im_end|> token, so the default uses it as end of turn.
    encoded = encode_chat(tokenizer, CONVERSATION[1:3], "assistant")
    assert [tokenizer.decode(s) for s in label_spans(encoded)] == [
        "I am a helpful assistant.<|im_end|>"
    ]


def test_truncation_strategies_count_and_cut():
    sample = {"input_ids": list(range(10)), "labels": [IGNORE_INDEX] * 4 + list(range(4, 10))}
    report = TruncationReport("right", 6)
    assert truncate(sample, 6, "right", report)["input_ids"] == [0, 1, 2, 3, 4, 5]
    assert truncate(sample, 6, "left", report)["labels"] == [4, 5, 6, 7, 8, 9]
    assert truncate(sample, 6, "delete", report) is None
    assert truncate(sample, 12, "delete", report) is sample
    assert report.counts == {"truncated": 2, "deleted": 1}
    prompt_only = {"input_ids": list(range(10)), "labels": [IGNORE_INDEX] * 8 + [8, 9]}
    assert truncate(prompt_only, 5, "right", report) is None
    assert report.counts["dropped (no label tokens left)"] == 1


@pytest.mark.bad_input(
    input="--truncation_strategy left or right cutting away every label token of a sample",
    outcome="The sample is dropped and counted in the truncation summary",
)
@pytest.mark.parametrize("strategy", ["left", "right"])
def test_truncation_that_leaves_no_label_tokens_drops_the_sample(strategy):
    # Left keeps [answer's last token, newline]: its one label is the first token, which no
    # earlier token predicts. Right keeps only prompt tokens.
    sample = {"input_ids": list(range(6)), "labels": [IGNORE_INDEX] * 3 + [3, 4, IGNORE_INDEX]}
    report = TruncationReport(strategy, 2)
    assert truncate(sample, 2, strategy, report) is None
    assert report.counts == {"dropped (no label tokens left)": 1}
    assert report.summary() == (
        f"--max_length 2 --truncation_strategy {strategy}: 1 dropped (no label tokens left)"
    )


def test_sample_without_label_tokens_is_dropped_even_when_it_fits():
    report = TruncationReport("delete", 10)
    sample = {"input_ids": [1, 2, 3], "labels": [1, IGNORE_INDEX, IGNORE_INDEX]}
    assert truncate(sample, 10, "delete", report) is None
    assert report.counts == {"dropped (no label tokens)": 1}


@pytest.mark.bad_input(
    input="--max_length 2 --truncation_strategy left: no sample keeps a label token",
    outcome="Stops before step 1 naming --max_length, --truncation_strategy and --loss_scope",
)
def test_data_without_any_label_token_is_an_error_naming_the_flags(tiny_tokenizer):
    samples = [{"messages": CONVERSATION[1:3], "source": f"x.jsonl:{n}"} for n in (1, 2)]
    with pytest.raises(DataError) as info:
        encode_chat_samples(tiny_tokenizer, samples, 2, "left", "assistant")
    assert str(info.value) == (
        "no sample has label tokens to train on with --max_length 2, --truncation_strategy "
        "left and --loss_scope assistant (of 2 samples: 2 dropped (no label tokens left)); "
        "raise --max_length, use --truncation_strategy left (it keeps the end of each "
        "conversation, where the last answer is) or --loss_scope all (loss on every token, "
        "prompts included)"
    )


def test_encode_chat_samples_reports_deleted(tiny_tokenizer):
    long = {
        "messages": [
            {"role": "user", "content": "word " * 80},
            {"role": "assistant", "content": "ok"},
        ],
        "source": "x.jsonl:1",
    }
    short = {"messages": CONVERSATION[1:3], "source": "x.jsonl:2"}
    encoded, report = encode_chat_samples(tiny_tokenizer, [long, short], 40, "delete", "assistant")
    assert len(encoded) == 1
    assert report.counts == {"deleted": 1}
    assert "1 deleted" in report.summary()


def test_pretraining_chunks_concatenate_documents_with_eos(tiny_tokenizer):
    texts = ["Hello! How can I help you today?", "The quick brown fox jumps over the lazy dog."]
    chunks, dropped = encode_pretraining(tiny_tokenizer, texts, 8)
    stream = [t for c in chunks for t in c["input_ids"]]
    expected = []
    for text in texts:
        expected += tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
        expected.append(tiny_tokenizer.eos_token_id)
    assert stream == expected and dropped == 0
    assert all(len(c["input_ids"]) == 8 for c in chunks[:-1])
    assert all(c["labels"] == c["input_ids"] for c in chunks)


@pytest.mark.bad_input(
    input="Pre-training text whose last chunk is a single token",
    outcome="The chunk is dropped and counted (nothing to predict)",
)
def test_pretraining_drops_and_counts_a_one_token_chunk(tiny_tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    length = len(tiny_tokenizer(text, add_special_tokens=False)["input_ids"]) + 1  # + EOS
    chunks, dropped = encode_pretraining(tiny_tokenizer, [text], length - 1)
    assert [len(c["input_ids"]) for c in chunks] == [length - 1]
    assert dropped == 1
    with pytest.raises(DataError, match="no pre-training chunk has a token to predict"):
        encode_pretraining(tiny_tokenizer, [text], 1)


def test_template_that_rewrites_history_is_reported(tiny_tokenizer, tmp_path):
    rewriting = (
        "{% for m in messages %}{% if loop.last %}{{ m['role'] + ':' + m['content'] + '\\n' }}"
        "{% else %}{{ m['role'] + '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tokenizer = build_tokenizer(tmp_path, chat_template=rewriting)
    with pytest.raises(Exception, match="re-renders earlier turns"):
        encode_chat(tokenizer, CONVERSATION[1:5], "assistant")


def as_text_parts(messages: list[dict]) -> list[dict]:
    """The same conversation with each content split into two text parts."""
    return [
        {
            **m,
            "content": [
                {"type": "text", "text": m["content"][:3]},
                {"type": "text", "text": m["content"][3:]},
            ],
        }
        for m in messages
    ]


@pytest.mark.parametrize("scope", ["assistant", "last_turn", "all"])
def test_text_part_lists_encode_exactly_like_strings(tmp_path, scope):
    # A string-only template (SmolLM's) would fail on lists: the parts are flattened first.
    tokenizer = build_tokenizer(tmp_path, chat_template=SMOLLM_TEMPLATE)
    expected = encode_chat(tokenizer, CONVERSATION, scope)
    assert encode_chat(tokenizer, as_text_parts(CONVERSATION), scope) == expected
    samples = [{"messages": as_text_parts(CONVERSATION), "source": "x.jsonl:1"}]
    encoded, _ = encode_chat_samples(tokenizer, samples, 1000, "delete", scope)
    assert encoded == [expected]


def test_images_are_refused_by_text_encoding(tiny_tokenizer):
    picture = [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "What is it?"}]
    sample = {
        "messages": [
            {"role": "user", "content": picture},
            {"role": "assistant", "content": "A cat."},
        ],
        "source": "x.jsonl:7",
    }
    with pytest.raises(DataError) as info:
        encode_chat_samples(tiny_tokenizer, [sample], 100, "delete", "assistant")
    assert str(info.value) == (
        "x.jsonl:7: message 1 has 1 image(s), which text-only chat encoding cannot use; "
        "remove its image parts"
    )


def trained_text(tokenizer, encoded: dict) -> list[str]:
    return [tokenizer.decode(span) for span in label_spans(encoded)]


@pytest.mark.bad_input(
    input='ms-swift\'s per-message `loss` key on assistant turns (`"loss": false`)',
    outcome="Honoured: the turn is trained or not whatever --loss_scope chose; with "
    "--loss_scope all, or on a user turn, an error naming the message",
)
def test_per_message_loss_overrides_the_scope_for_that_turn(tmp_path):
    from swiftlm.data.formats import RowError, chat_sample

    tokenizer = build_tokenizer(tmp_path)
    row = {"messages": [dict(m) for m in CONVERSATION]}
    row["messages"][2]["loss"] = False
    messages = chat_sample(row)["messages"]
    assert trained_text(tokenizer, encode_chat(tokenizer, messages, "assistant")) == [
        "The capital of France is Paris.<|im_end|>"
    ]
    row["messages"][2]["loss"], row["messages"][4]["loss"] = True, False
    messages = chat_sample(row)["messages"]
    assert trained_text(tokenizer, encode_chat(tokenizer, messages, "last_turn")) == [
        "I am a helpful assistant.<|im_end|>"
    ]
    with pytest.raises(DataError, match="message 3 sets 'loss'.*--loss_scope all"):
        encode_chat(tokenizer, messages, "all")
    row["messages"][1]["loss"] = True
    with pytest.raises(RowError, match=r"message 2 \(user\) has 'loss'"):
        chat_sample(row)
    row["messages"][1].pop("loss")
    row["messages"][2]["loss"] = "yes"
    with pytest.raises(RowError, match="'loss' must be true or false, got str"):
        chat_sample(row)
