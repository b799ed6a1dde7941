"""Dataset columns: those for another method are refused by name, unknown ones are reported
once with counts, and the `system` column is used by every chat format."""

from collections import Counter

import pytest

from conftest import write_jsonl
from swiftlm.data.columns import refuse_media_parts
from swiftlm.data.formats import RowError, chat_sample, text_sample, to_text
from swiftlm.data.loading import DataValidationError, LoadReport, load_samples
from swiftlm.infer.batch import prompt_sample
from tool_templates import WEATHER_TOOL, openai_tool_row

CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
PREFERENCE = "preference data for swiftlm rlhf (DPO)"
MULTIMODAL = (
    "images need a vision-language --model (Qwen2-VL, LLaVA, SmolVLM/Idefics3 ...; sft, rlhf "
    "--rlhf_type dpo, infer and deploy take images), and this sft run's model is text-only"
)


def refusal(to_sample, record) -> tuple[str, str]:
    with pytest.raises(RowError) as info:
        to_sample(record)
    return info.value.kind, str(info.value)


@pytest.mark.bad_input(
    input="A column for another method (rejected_response, chosen/rejected, label) in SFT rows",
    outcome="The row is refused naming the column, what it is for and that sft does not use it",
)
@pytest.mark.parametrize(
    "record, column, what",
    [
        ({"messages": CHAT, "rejected_response": "Go away"}, "rejected_response", PREFERENCE),
        ({"prompt": "Hi", "chosen": "Hello", "rejected": "Go away"}, "chosen", PREFERENCE),
        (
            {"messages": CHAT, "label": True},
            "label",
            "a KTO desirability label or a classification label, for swiftlm rlhf --rlhf_type "
            "kto or sequence classification (not available yet)",
        ),
    ],
)
def test_columns_for_another_method_are_refused_by_name(record, column, what):
    assert refusal(chat_sample, record) == (
        "column for another method",
        f"column {column!r} is {what}; sft does not use it: remove the column",
    )


@pytest.mark.bad_input(
    input="An images (videos, audios) column with `<image>` tags, on a text model",
    outcome="The row is refused: images need a vision-language --model, naming the commands "
    "that take them",
)
def test_media_columns_are_refused_as_multimodal(tmp_path):
    row = {
        "messages": [
            {"role": "user", "content": "<image>What is it?"},
            {"role": "assistant", "content": "A cat."},
        ],
        "images": ["cat.png"],
    }
    path = write_jsonl(tmp_path / "pictures.jsonl", [{"messages": CHAT}, row])
    with pytest.raises(DataValidationError) as info:
        load_samples([str(path)], chat_sample)
    assert str(info.value).splitlines()[0] == (
        f"{path}:2: column 'images' holds images for the <image> tags of the text; "
        f"{MULTIMODAL}: pass a vision-language --model, or remove the column (and its tags)"
    )
    assert info.value.bad_rows[0].kind == "media"


def test_empty_media_columns_count_as_absent():
    # Mixed datasets leave the column empty on rows without media.
    sample = chat_sample({"messages": CHAT, "images": [], "videos": None})
    assert sample == {"messages": CHAT}


@pytest.mark.bad_input(
    input="Image content parts in SFT, PT or inference rows",
    outcome="The row is refused: images need a vision-language --model",
)
def test_image_parts_are_refused_by_text_methods():
    picture = [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "What is it?"}]
    messages = [{"role": "user", "content": picture}, {"role": "assistant", "content": "A cat."}]
    with pytest.raises(RowError) as info:
        refuse_media_parts(messages, "sft")
    assert str(info.value) == (
        f"message 1 (user) has 1 image part(s); {MULTIMODAL}: remove the image parts"
    )
    assert refusal(to_text, {"messages": messages})[0] == "media"
    assert refusal(lambda r: prompt_sample(r, require_answer=False), {"messages": messages}) == (
        "media",
        "message 1 (user) has 1 image part(s); "
        f"{MULTIMODAL.replace('this sft', 'this infer')}: remove the image parts",
    )


@pytest.mark.bad_input(
    input="A tools column or tool-call messages in pt rows",
    outcome="The row is refused: tool calls are trained by swiftlm sft",
)
def test_pretraining_refuses_tools_and_tool_calls():
    assert refusal(text_sample, {"text": "doc", "tools": [WEATHER_TOOL]}) == (
        "column for another method",
        "column 'tools' is tool-calling data, which swiftlm sft trains on; pt does not use it: "
        "remove the column",
    )
    record = {key: value for key, value in openai_tool_row().items() if key != "tools"}
    assert refusal(text_sample, record) == (
        "tool calls",
        "message 2 is a tool call; pt trains on plain text: train tool calls with swiftlm sft, "
        "or give the row a 'text' column",
    )


@pytest.mark.bad_input(
    input="Tools or tool calls in swiftlm infer prompts",
    outcome="The row is refused: infer does not pass tools to the chat template yet",
)
def test_inference_prompts_refuse_tools():
    assert refusal(lambda r: prompt_sample(r, require_answer=False), openai_tool_row()) == (
        "tool calls",
        "the row has tools or tool calls, which swiftlm infer does not pass to the chat "
        "template yet: remove the 'tools' column and the tool-call turns",
    )


@pytest.mark.bad_input(
    input="Columns swiftlm does not know (id, source ...) beside a chat or text format",
    outcome="Not refused; counted and reported once as not used (LoadReport.notices)",
)
def test_unknown_columns_are_reported_once_with_counts(tmp_path):
    rows = [
        {"messages": CHAT, "id": 1, "source": "hub", "system": None},
        {"messages": CHAT, "id": 2, "source": "hub", "tools": [WEATHER_TOOL]},
        {"query": "q", "response": "r", "id": 3, "history": None, "text": "not read by sft"},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    samples, report = load_samples([str(path)], chat_sample)
    assert report.unused_columns == Counter({"id": 3, "source": 2, "text": 1})
    assert report.notices("sft") == [
        "data: columns not used by sft: id (3 rows), source (2 rows), text (1 row)"
    ]
    assert samples[0]["source"] == f"{path}:1"  # the loader's own key, not the column's
    # pt refuses row 2 (its tools) and row 3, whose text and conversation are two readings.
    _, pt_report = load_samples([str(path)], text_sample, skip_bad_rows=True)
    assert pt_report.notices("pt") == ["data: columns not used by pt: id (1 row), source (1 row)"]
    assert pt_report.bad_kinds["two layouts"] == 1
    assert LoadReport().notices("sft") == []


def test_rows_of_another_schema_report_no_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "extra": 1}])
    _, report = load_samples([str(path)], lambda record: {"prompt": record["prompt"]})
    assert report.notices("custom") == []


@pytest.mark.bad_input(
    input="A 'system' column on a messages-format row",
    outcome="Used as the first (system) message",
)
def test_system_column_applies_to_the_messages_format():
    sample = chat_sample({"system": "Be brief.", "messages": CHAT})
    assert sample["messages"] == [{"role": "system", "content": "Be brief."}, *CHAT]


@pytest.mark.bad_input(
    input="A 'system' column and a system message in the same row",
    outcome="The row is refused: keep one",
)
def test_system_column_and_system_message_conflict():
    record = {"system": "A", "messages": [{"role": "system", "content": "B"}, *CHAT]}
    assert refusal(chat_sample, record) == (
        "conflicting system",
        "the row has both a 'system' column and a system message (message 1); keep one",
    )
