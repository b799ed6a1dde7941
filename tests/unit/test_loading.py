"""Loading specs into samples: validation of every row, skipping, #N sampling, splitting."""

import json
from collections import Counter
from functools import partial

import pytest

from swiftlm.data.formats import RowError, chat_sample, text_sample
from swiftlm.data.loading import (
    BadRow,
    DataValidationError,
    LoadReport,
    load_samples,
    sample_rows,
    split_samples,
)
from swiftlm.data.sources import builtin_dataset_path
from swiftlm.errors import DataError


def chat(i):
    return {
        "messages": [
            {"role": "user", "content": f"q{i}"},
            {"role": "assistant", "content": f"a{i}"},
        ]
    }


def write_jsonl(path, rows):
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def questions(samples):
    return [s["messages"][0]["content"] for s in samples]


EMPTY_ANSWER = {"instruction": "x", "output": " "}


def mixed_bad_file(tmp_path):
    """Rows 2, 4 and 5 are bad: invalid JSON, empty assistant answer, not an object."""
    return write_jsonl(tmp_path / "mixed.jsonl", [chat(1), "{oops", chat(3), EMPTY_ANSWER, "[1]"])


def test_chat_samples_carry_messages_and_source(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(0), {"query": "q1", "response": "a1"}])
    samples, report = load_samples([path], chat_sample)
    assert samples == [
        {"messages": chat(0)["messages"], "source": f"{path}:1"},
        {"messages": chat(1)["messages"], "source": f"{path}:2"},
    ]
    assert report.rows_read == Counter({path: 2})
    assert report.samples == {path: 2}
    assert report.summary() == "no bad rows"


def test_text_samples(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "doc one"}, {"text": "doc two {{NAME}}"}])
    samples, _ = load_samples([path], text_sample)
    assert samples == [
        {"text": "doc one", "source": f"{path}:1"},
        {"text": "doc two {{NAME}}", "source": f"{path}:2"},
    ]


def preference(record):
    """A method's own row schema: prompt/chosen/rejected strings, no chat format."""
    if not all(isinstance(record.get(key), str) for key in ("prompt", "chosen", "rejected")):
        raise RowError("bad field type", "need string 'prompt', 'chosen' and 'rejected'")
    return {key: record[key] for key in ("prompt", "chosen", "rejected")}


def test_any_row_schema_loads_with_its_own_columns(tmp_path):
    calls = []

    def to_sample(record):
        calls.append(record)
        return preference(record)

    good = {"prompt": "p", "chosen": "c", "rejected": "r", "extra": 1}
    path = write_jsonl(tmp_path / "d.jsonl", [good, "{oops", {"prompt": "p"}, "[1]"])
    samples, report = load_samples([path], to_sample, skip_bad_rows=True)
    assert samples == [{"prompt": "p", "chosen": "c", "rejected": "r", "source": f"{path}:1"}]
    assert report.skipped == Counter({"invalid JSON": 1, "bad field type": 1, "not an object": 1})
    assert [r.reason for r in report.bad_rows][1] == "need string 'prompt', 'chosen' and 'rejected'"
    # Rows that are not JSON objects never reach the method's schema.
    assert calls == [good, {"prompt": "p"}]


def test_system_and_placeholders_apply_to_every_oversampled_copy(tmp_path):
    rows = [
        {"query": "Who is {{NAME}}?", "response": "{{NAME}}."},
        {"messages": [{"role": "system", "content": "S"}, *chat(1)["messages"]]},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    to_sample = partial(chat_sample, system="Sys {{NAME}}", placeholders={"{{NAME}}": "Zed"})
    samples, report = load_samples([f"{path}#5"], to_sample, seed=3)
    first = [
        {"role": "system", "content": "Sys Zed"},
        {"role": "user", "content": "Who is Zed?"},
        {"role": "assistant", "content": "Zed."},
    ]
    second = [{"role": "system", "content": "S"}, *chat(1)["messages"]]
    assert [s["messages"] for s in samples[:4]] == [first, second, first, second]
    assert samples[4]["messages"] in (first, second)
    assert report.samples == {f"{path}#5": 5}


def test_bad_rows_raise_with_file_line_reasons(tmp_path):
    path = mixed_bad_file(tmp_path)
    with pytest.raises(DataValidationError) as info:
        load_samples([path], chat_sample)
    assert str(info.value) == "\n".join(
        [
            f"{path}:2: invalid JSON: Expecting property name enclosed in double quotes at column 2",
            f"{path}:4: empty assistant answer in message 2",
            f"{path}:5: expected a JSON object",
            "3 of 5 rows are invalid; fix them or pass --skip_bad_rows to skip them",
        ]
    )
    assert info.value.total == 5
    assert [(r.line, r.kind) for r in info.value.bad_rows] == [
        (2, "invalid JSON"),
        (4, "empty assistant answer"),
        (5, "not an object"),
    ]
    assert isinstance(info.value, DataError)


def test_bad_rows_of_all_datasets_are_collected_before_raising(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", [chat(0), EMPTY_ANSWER])
    second = write_jsonl(tmp_path / "b.jsonl", [{"question": "?"}, chat(1), chat(2)])
    with pytest.raises(DataValidationError) as info:
        load_samples([first, second], chat_sample)
    assert [(r.source, r.line) for r in info.value.bad_rows] == [(first, 2), (second, 1)]
    assert str(info.value).endswith(
        "2 of 5 rows are invalid; fix them or pass --skip_bad_rows to skip them"
    )


def test_error_lists_at_most_20_bad_rows(tmp_path):
    rows = [chat(0)] + [EMPTY_ANSWER] * 25
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataValidationError) as info:
        load_samples([path], chat_sample)
    lines = str(info.value).splitlines()
    assert len(lines) == 22
    assert lines[0] == f"{path}:2: empty assistant answer in message 2"
    assert lines[19] == f"{path}:21: empty assistant answer in message 2"
    assert lines[20] == "... and 5 more"
    assert lines[21] == "25 of 26 rows are invalid; fix them or pass --skip_bad_rows to skip them"
    assert len(info.value.bad_rows) == 25


def test_skip_bad_rows_counts_by_kind(tmp_path):
    path = mixed_bad_file(tmp_path)
    extra = write_jsonl(tmp_path / "e.jsonl", [EMPTY_ANSWER, chat(9)])
    samples, report = load_samples([path, extra], chat_sample, skip_bad_rows=True)
    assert questions(samples) == ["q1", "q3", "q9"]
    assert report.skipped == Counter(
        {"empty assistant answer": 2, "invalid JSON": 1, "not an object": 1}
    )
    assert report.summary() == (
        "skipped 4 bad rows: 2 empty assistant answer, 1 invalid JSON, 1 not an object"
    )
    assert [(r.source, r.line) for r in report.bad_rows] == [
        (path, 2),
        (path, 4),
        (path, 5),
        (extra, 1),
    ]
    assert report.total_rows == 7


def test_summary_singular():
    report = LoadReport(skipped=Counter({"invalid JSON": 1}))
    assert report.summary() == "skipped 1 bad row: 1 invalid JSON"


def test_data_validation_error_from_bad_rows_directly():
    error = DataValidationError([BadRow("f.csv", 3, "empty text", "empty text")], total=10)
    assert str(error) == (
        "f.csv:3: empty text\n1 of 10 rows are invalid; fix them or pass --skip_bad_rows to skip them"
    )


def test_no_valid_samples_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [EMPTY_ANSWER])
    with pytest.raises(DataError) as info:
        load_samples([path], chat_sample, skip_bad_rows=True)
    assert str(info.value) == f"no valid samples in dataset(s) {path}"


def test_require_answer_false_allows_open_prompts(tmp_path):
    row = {"messages": [{"role": "user", "content": "hi"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(DataValidationError):
        load_samples([path], chat_sample)
    samples, _ = load_samples([path], partial(chat_sample, require_answer=False))
    assert samples[0]["messages"] == row["messages"]


def test_system_inserted_only_where_missing_and_placeholders_filled(tmp_path):
    with_system = {
        "messages": [
            {"role": "system", "content": "Own {{NAME}}"},
            {"role": "user", "content": "Who?"},
            {"role": "assistant", "content": "{{NAME}} by {{AUTHOR}}, {{NAME}}."},
        ]
    }
    path = write_jsonl(tmp_path / "d.jsonl", [with_system, chat(1)])
    to_sample = partial(
        chat_sample, system="Be brief.", placeholders={"{{NAME}}": "Swifty", "{{AUTHOR}}": "Team"}
    )
    samples, _ = load_samples([path], to_sample)
    assert samples[0]["messages"] == [
        {"role": "system", "content": "Own Swifty"},
        {"role": "user", "content": "Who?"},
        {"role": "assistant", "content": "Swifty by Team, Swifty."},
    ]
    assert (
        samples[1]["messages"] == [{"role": "system", "content": "Be brief."}] + chat(1)["messages"]
    )


def test_specs_are_concatenated_in_order(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", [chat(0), chat(1)])
    second = write_jsonl(tmp_path / "b.jsonl", [chat(2)])
    samples, report = load_samples([second, first], chat_sample)
    assert questions(samples) == ["q2", "q0", "q1"]
    assert report.samples == {second: 1, first: 2}


def test_hash_n_takes_a_seeded_subset_in_file_order(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(i) for i in range(10)])
    samples, report = load_samples([f"{path}#4"], chat_sample, seed=1)
    again, _ = load_samples([f"{path}#4"], chat_sample, seed=1)
    other, _ = load_samples([f"{path}#4"], chat_sample, seed=2)
    picked = questions(samples)
    assert picked == questions(again)
    assert picked != questions(other)
    assert len(set(picked)) == 4
    assert picked == sorted(picked, key=lambda q: int(q[1:]))
    assert report.samples == {f"{path}#4": 4}


def test_hash_n_oversamples_whole_copies_plus_remainder(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(i) for i in range(3)])
    samples, _ = load_samples([f"{path}#8"], chat_sample, seed=5)
    picked = questions(samples)
    assert picked[:6] == ["q0", "q1", "q2", "q0", "q1", "q2"]
    assert len(picked) == 8
    assert len(set(picked[6:])) == 2
    assert picked == questions(load_samples([f"{path}#8"], chat_sample, seed=5)[0])


def test_hash_n_counts_after_dropping_bad_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(0), EMPTY_ANSWER, chat(2)])
    samples, _ = load_samples([f"{path}#2"], chat_sample, skip_bad_rows=True)
    assert questions(samples) == ["q0", "q2"]


def test_sample_rows_exact_values():
    rows = list(range(10))
    assert sample_rows(rows, 3, seed=0) == sample_rows(rows, 3, seed=0)
    assert sample_rows(rows, 10, seed=0) == rows
    assert sample_rows(rows, 23, seed=0)[:20] == rows + rows
    assert sample_rows([], 5, seed=0) == []


@pytest.mark.parametrize(
    ("n", "ratio", "expected_val"),
    [(100, 0.1, 10), (10, 0.25, 2), (10, 0.01, 1), (2, 0.9, 1), (1, 0.5, 0), (10, 0.0, 0)],
)
def test_split_sizes(n, ratio, expected_val):
    samples = list(range(n))
    train, val = split_samples(samples, ratio, seed=3)
    assert len(val) == expected_val
    assert len(train) == n - expected_val
    assert sorted(train + val) == samples
    assert train == sorted(train) and val == sorted(val)


def test_split_is_deterministic_per_seed():
    samples = list(range(50))
    assert split_samples(samples, 0.2, seed=7) == split_samples(samples, 0.2, seed=7)
    assert split_samples(samples, 0.2, seed=7)[1] != split_samples(samples, 0.2, seed=8)[1]


@pytest.mark.parametrize("ratio", [1.0, -0.1, 1.5, float("nan")])
def test_split_rejects_bad_ratio(ratio):
    with pytest.raises(DataError) as info:
        split_samples([1, 2, 3], ratio, seed=0)
    assert "split_dataset_ratio must be in [0, 1)" in str(info.value)


def test_builtin_dataset_loads_with_placeholders_filled():
    # The asset ships in the package (pyproject package-data); its absence is the regression.
    path = builtin_dataset_path("swiftlm/self-cognition")
    assert path.is_file(), f"packaged asset {path} is missing from the installed swiftlm"
    samples, report = load_samples(
        ["swiftlm/self-cognition"],
        partial(chat_sample, placeholders={"{{NAME}}": "Zork", "{{AUTHOR}}": "Acme"}),
    )
    assert len(samples) == report.total_rows > 0
    assert all(s["source"].startswith("swiftlm/self-cognition:") for s in samples)
    text = json.dumps([s["messages"] for s in samples], ensure_ascii=False)
    assert "{{NAME}}" not in text and "{{AUTHOR}}" not in text
    assert "Zork" in text
    assert report.summary() == "no bad rows"


# --- row schemas ------------------------------------------------------------------------


def msg(role, content):
    return {"role": role, "content": content}


def test_chat_sample_inserts_system_and_fills_placeholders_in_text_parts():
    picture = {"type": "image", "image": "{{NAME}}.png"}
    parts = [{"type": "text", "text": "Hi {{NAME}}"}, picture]
    record = {"messages": [msg("user", parts), msg("assistant", "I am {{NAME}} by {{AUTHOR}}.")]}
    placeholders = {"{{NAME}}": "Zed", "{{AUTHOR}}": "Acme"}
    sample = chat_sample(record, system="You are {{NAME}}.", placeholders=placeholders)
    assert sample == {
        "messages": [
            msg("system", "You are Zed."),
            msg("user", [{"type": "text", "text": "Hi Zed"}, picture]),  # image refs as given
            msg("assistant", "I am Zed by Acme."),
        ]
    }
    assert record["messages"][1]["content"] == "I am {{NAME}} by {{AUTHOR}}."  # not modified
    own = {"messages": [msg("system", "Own"), msg("user", "q"), msg("assistant", "a")]}
    assert chat_sample(own, system="Other")["messages"][0] == msg("system", "Own")


def test_chat_sample_validates_before_filling_placeholders():
    sample = chat_sample({"query": "q", "response": "{{NAME}}"}, placeholders={"{{NAME}}": ""})
    assert sample["messages"][-1] == msg("assistant", "")
    with pytest.raises(RowError) as info:
        chat_sample({"query": "q"})
    assert info.value.kind == "no recognizable format"
    assert chat_sample({"query": "q"}, require_answer=False) == {"messages": [msg("user", "q")]}


def test_text_sample_keeps_placeholders_as_written():
    assert text_sample({"text": "{{NAME}} stays"}) == {"text": "{{NAME}} stays"}
    with pytest.raises(RowError):
        text_sample({"text": ""})
