"""The data contract through `swiftlm sft`/`pt`: tool calls train through the chat template's
tools, media rows and vision-language folders are refused, data without label tokens stops
before step 1, and dataset folders are read whole."""

import json

import pytest

from conftest import CHAT_ROWS, build_tiny_llama, build_tokenizer, logged, tiny_sft, write_jsonl
from swiftlm.cli.main import main
from tool_templates import TOOL_CHATML, openai_tool_row

MS_SWIFT_ROW = {
    "tools": json.dumps([openai_tool_row()["tools"][0]]),
    "messages": [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "tool_call", "content": '{"name": "get_weather", "arguments": {"city": "Rome"}}'},
        {"role": "tool_response", "content": "rainy"},
        {"role": "assistant", "content": "Rainy in Rome."},
    ],
}


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """The tiny Llama with a ChatML tokenizer whose template renders tools (Qwen2.5-style)."""
    out = tmp_path_factory.mktemp("tiny-llama-tools")
    tokenizer = build_tokenizer(out, chat_template=TOOL_CHATML)
    build_tiny_llama(out, vocab_size=len(tokenizer))
    return out


def test_sft_trains_tool_calls_with_the_templates_tools(tool_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "agent.jsonl", [openai_tool_row(), MS_SWIFT_ROW] * 4)
    out = tmp_path / "run"
    flags = dict(max_steps=2, per_device_train_batch_size=4, load_from_cache_file="false")
    assert main(tiny_sft(tool_model_dir, data, out, **flags)) == 0
    assert "data: 8 samples, " in capsys.readouterr().out
    # Per sample: the call turn and the answer turn carry labels.
    assert all(count > 0 for count in logged(out, "label_tokens"))


@pytest.mark.bad_input(
    input="swiftlm sft on tool-calling rows with a model whose chat template has no tools",
    outcome="Stops before training: file:line, the template does not render tools, which model "
    "to use",
)
def test_sft_tool_rows_on_a_template_without_tools_stop_naming_the_row(
    tiny_model_dir, tmp_path, capsys
):
    data = write_jsonl(tmp_path / "agent.jsonl", [CHAT_ROWS[0], openai_tool_row()])
    out = tmp_path / "run"
    assert main(tiny_sft(tiny_model_dir, data, out, max_steps=2)) == 1
    err = capsys.readouterr().err
    assert f"{data}:2: the row has a 'tools' list, but this model's chat template" in err
    assert "e.g. Qwen2.5-Instruct" in err
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.bad_input(
    input="swiftlm sft of a text-only model on rows with an images column and `<image>` tags, "
    "or image parts",
    outcome="Stops before training listing each row (file:line): images need a "
    "vision-language --model",
)
def test_sft_on_image_rows_stops_naming_each_row(tiny_model_dir, tmp_path, capsys):
    tagged = {
        "messages": [
            {"role": "user", "content": "<image>What is it?"},
            {"role": "assistant", "content": "A cat."},
        ],
        "images": ["cat.png"],
    }
    picture = [
        {"type": "image_url", "image_url": {"url": "cat.png"}},
        {"type": "text", "text": "?"},
    ]
    parts = {"messages": [{"role": "user", "content": picture}, tagged["messages"][1]]}
    data = write_jsonl(tmp_path / "pictures.jsonl", [*CHAT_ROWS[:2], tagged, parts])
    out = tmp_path / "run"
    assert main(tiny_sft(tiny_model_dir, data, out, max_steps=1)) == 1
    err = capsys.readouterr().err
    assert f"{data}:3: column 'images' holds images for the <image> tags of the text" in err
    assert f"{data}:4: message 1 (user) has 1 image part(s); images need a vision-language" in err
    assert "2 of 4 rows are invalid" in err
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.bad_input(
    input="swiftlm sft --max_length 2 --truncation_strategy left (or right)",
    outcome="Stops before step 1: no sample has label tokens, naming the flags to change",
)
@pytest.mark.parametrize("strategy", ["left", "right"])
def test_truncation_to_no_label_tokens_stops_before_step_one(
    tiny_model_dir, chat_jsonl, tmp_path, capsys, strategy
):
    out = tmp_path / "run"
    flags = dict(max_steps=2, max_length=2, truncation_strategy=strategy)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, out, **flags)) == 1
    err = capsys.readouterr().err
    assert (
        f"no sample has label tokens to train on with --max_length 2, --truncation_strategy "
        f"{strategy} and --loss_scope assistant (of 24 samples: 24 dropped (no label tokens "
        "left)); raise --max_length"
    ) in err
    assert not (out / "metrics.jsonl").exists()


def test_dataset_folder_with_subfolders_trains_on_every_file(tiny_model_dir, tmp_path, capsys):
    folder = tmp_path / "data"
    (folder / "more" / "deeper").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", CHAT_ROWS[:4])
    write_jsonl(folder / "more" / "b.jsonl", CHAT_ROWS[4:10])
    write_jsonl(folder / "more" / "deeper" / "c.jsonl", CHAT_ROWS[10:12])
    (folder / "README.md").write_text("# a dataset card")
    assert main(tiny_sft(tiny_model_dir, folder, tmp_path / "run", max_steps=1)) == 0
    assert "data: 12 samples, " in capsys.readouterr().out


@pytest.mark.bad_input(
    input="Columns swiftlm does not know (`id`, `source` beside `messages`)",
    outcome="Trained on; the columns are named once in the log as not used, with row counts",
)
def test_sft_reports_unused_columns_once(tiny_model_dir, tmp_path, capsys):
    rows = [{**row, "id": n, "source": "hub"} for n, row in enumerate(CHAT_ROWS)]
    data = write_jsonl(tmp_path / "hub.jsonl", rows)
    assert main(tiny_sft(tiny_model_dir, data, tmp_path / "run", max_steps=1)) == 0
    out = capsys.readouterr().out
    assert out.count("data: columns not used by sft: id (24 rows), source (24 rows)") == 1
