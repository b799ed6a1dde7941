"""A row that two layouts could read, or whose score would be undefined, is refused by
`file:line` with the reason, never read one way silently: the training and inference formats
(`data/formats.py`), preference pairs (`data/preference.py`) and evaluation rows
(`evaluation/`: each task kind's `read_row`)."""

import pytest

from conftest import write_jsonl
from swiftlm.data.formats import chat_sample, text_sample
from swiftlm.data.loading import DataValidationError, load_samples
from swiftlm.data.preference import preference_sample
from swiftlm.evaluation.task_file import read_task_rows

CHAT = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
SHAREGPT = [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]
ALPACA = {"instruction": "Say hi.", "output": "Hi."}


def refusals(tmp_path, rows: list[dict], read) -> str:
    """The loader's error for `rows` (row 1 is good), read by `read(spec)`."""
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DataValidationError) as info:
        read(str(path))
    return str(info.value).replace(str(path), "rows.jsonl")


@pytest.mark.bad_input(
    input="A row in two layouts at once: `messages` beside `instruction`/`output` (Alpaca) or "
    "`query`/`response`, `conversations` (ShareGPT) beside Alpaca, `text` beside a "
    "conversation for pt, ms-swift's `rejected_response` beside TRL's `chosen`/`rejected`",
    outcome="Refused by file:line naming both layouts and saying to keep one (before, the first "
    "layout in detection order was read and the other dropped)",
)
def test_a_row_in_two_layouts_is_refused_by_file_and_line(tmp_path):
    rows = [
        {"messages": CHAT},
        {"messages": CHAT, **ALPACA},
        {"conversations": SHAREGPT, **ALPACA},
        {"messages": CHAT, "query": "Hi?", "response": "Hello."},
    ]
    error = refusals(tmp_path, rows, lambda spec: load_samples([spec], chat_sample))
    assert (
        "rows.jsonl:2: the row is in two layouts at once: 'messages' (role/content list) " in error
    )
    assert "and 'instruction' + 'output' (Alpaca); swiftlm would read one and drop" in error
    assert "rows.jsonl:3: the row is in two layouts at once: 'conversations' (ShareGPT)" in error
    assert "rows.jsonl:4: the row is in two layouts at once: 'messages'" in error
    assert "3 of 4 rows are invalid" in error

    pt_rows = [{"text": "plain"}, {"text": "plain", "messages": CHAT}]
    error = refusals(tmp_path, pt_rows, lambda spec: load_samples([spec], text_sample))
    assert "rows.jsonl:2: the row is in two layouts at once: 'text' and 'messages'" in error
    assert "pt would read one" in error

    pairs = [
        {"messages": CHAT, "rejected_response": "Go away."},
        {"messages": CHAT, "rejected_response": "Go away.", "chosen": "Hello.", "rejected": "No."},
    ]
    error = refusals(
        tmp_path, pairs, lambda s: load_samples([s], lambda r: preference_sample(r, method="dpo"))
    )
    assert "rows.jsonl:2: the row is in both preference layouts: ms-swift (messages + " in error
    assert "rejected_response) and TRL (chosen + rejected)" in error


@pytest.mark.bad_input(
    input="`swiftlm eval` rows whose score is undefined or that two readings fit: repeated "
    "`choices`, an answer letter that is also another choice's text, `answer` and `label` "
    "naming different choices, `question` beside `query`, `choices` beside `messages`, "
    "`question`/`answer` beside `messages` or `prompt`/`completion`",
    outcome="Refused by file:line before the model loads, naming the columns and what to change",
)
def test_an_eval_row_with_an_undefined_score_is_refused_by_file_and_line(tmp_path):
    good = {"question": "2+2?", "choices": ["3", "4"], "answer": 1}
    rows = [
        good,
        {"question": "Pick", "choices": ["yes", "no", "yes"], "answer": 0},
        {"question": "Pick", "choices": ["B", "A"], "answer": "A"},
        {"question": "Pick", "choices": ["x", "y"], "answer": 0, "label": 1},
        {"question": "Pick", "query": "Pick?", "choices": ["x", "y"], "answer": 0},
        {"question": "Pick", "choices": ["x", "y"], "answer": 0, "messages": CHAT},
    ]
    error = refusals(tmp_path, rows, lambda spec: read_task_rows(spec, "multiple_choice", {}))
    assert (
        "rows.jsonl:2: choices 1 and 3 are both 'yes': with a repeated choice the row's " in error
    )
    assert "rows.jsonl:3: 'answer' 'A' is both the letter of choice 1 and the text of choice 2" in (
        error
    )
    assert "rows.jsonl:4: 'answer' 0 and 'label' 1 name different choices" in error
    assert "rows.jsonl:5: the row has 'question' and 'query', each of which could be the " in error
    assert "rows.jsonl:6: the row is in two layouts at once: 'choices' (multiple choice) and " in (
        error
    )

    qa = [
        {"question": "Capital of France?", "answer": "Paris"},
        {"question": "Capital of France?", "answer": "Paris", "messages": CHAT},
        {"question": "Q", "answer": "A", "prompt": "P", "completion": "C"},
    ]
    error = refusals(tmp_path, qa, lambda spec: read_task_rows(spec, "generation", {}))
    assert "rows.jsonl:2: the row is in two layouts at once: 'question' + 'answer' and " in error
    assert "rows.jsonl:3: the row is in two layouts at once: 'question' + 'answer' and " in error
    assert "'prompt' + 'completion'" in error


def test_consistent_answer_columns_and_one_layout_still_read(tmp_path):
    rows = [{"question": "2+2?", "choices": ["3", "4"], "answer": "B", "label": 1}]
    path = write_jsonl(tmp_path / "mc.jsonl", rows)
    kind, samples = read_task_rows(str(path), None, {})
    assert (kind, samples[0].label) == ("multiple_choice", 1)
    # Empty or null columns of another layout (mixed hub datasets) are not a second layout.
    row = {"messages": CHAT, "instruction": None, "query": "", "conversations": []}
    assert chat_sample(row)["messages"] == CHAT
