"""Reading raw rows from files, folders, built-in and hub datasets, with line numbers."""

import json
import sys
import types
from fnmatch import fnmatch
from pathlib import Path

import pytest

from swiftlm.data.sources import (
    BUILTIN_DATASETS,
    RawRow,
    builtin_dataset_path,
    parse_dataset_spec,
    read_rows,
)
from swiftlm.errors import DataError

try:
    import tomllib
except ImportError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib


def rows_of(path):
    return list(read_rows(str(path)))


# --- specs ------------------------------------------------------------------------------


def test_parse_dataset_spec():
    assert parse_dataset_spec("data/train.jsonl") == ("data/train.jsonl", None)
    assert parse_dataset_spec("data/train.jsonl#500") == ("data/train.jsonl", 500)
    assert parse_dataset_spec("org/name:subset#3") == ("org/name:subset", 3)


@pytest.mark.parametrize("spec", ["a.jsonl#abc", "a.jsonl#0", "a.jsonl#-2", "a.jsonl#"])
def test_parse_dataset_spec_rejects_bad_counts(spec):
    with pytest.raises(DataError) as info:
        parse_dataset_spec(spec)
    assert f"bad dataset spec {spec!r}" in str(info.value)
    assert "positive whole number" in str(info.value)


def test_parse_dataset_spec_keeps_existing_file_with_hash_in_name(tmp_path):
    path = tmp_path / "v#2.jsonl"
    path.write_text("")
    assert parse_dataset_spec(str(path)) == (str(path), None)


# --- jsonl ------------------------------------------------------------------------------


def test_jsonl_rows_errors_and_line_numbers(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n\n   \n{"a": 2\n[1, 2]\n{"a": 3}\n', encoding="utf-8")
    assert rows_of(path) == [
        RawRow(str(path), 1, {"a": 1}, None),
        RawRow(str(path), 4, None, "invalid JSON: Expecting ',' delimiter at column 8"),
        RawRow(str(path), 5, None, "expected a JSON object"),
        RawRow(str(path), 6, {"a": 3}, None),
    ]


def test_jsonl_bad_utf8_line_is_one_bad_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n{"a": "\xff"}\n{"a": 2}\n')
    rows = rows_of(path)
    assert [(r.line, r.record) for r in rows] == [(1, {"a": 1}), (2, None), (3, {"a": 2})]
    assert rows[1].error == "invalid JSON: not UTF-8 text (invalid start byte)"


# --- json -------------------------------------------------------------------------------


def test_json_array_element_start_lines(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(
        "[\n"  # 1
        "  {\n"  # 2
        '    "a": "x\\ny",\n'  # 3: an escaped newline inside a string is not a line
        '    "b": [1,\n'  # 4
        "          2]\n"  # 5
        "  },\n"  # 6
        '  {"a": 2}, {"a": 3},\n'  # 7
        "\n"  # 8
        "  4\n"  # 9
        "]\n"
    )
    assert rows_of(path) == [
        RawRow(str(path), 2, {"a": "x\ny", "b": [1, 2]}, None),
        RawRow(str(path), 7, {"a": 2}, None),
        RawRow(str(path), 7, {"a": 3}, None),
        RawRow(str(path), 9, None, "expected a JSON object"),
    ]


def test_json_object_with_one_list(tmp_path):
    path = tmp_path / "d.json"
    data = {"version": "1", "meta": {"n": [5]}, "data": [{"q": 1}, {"q": 2}]}
    path.write_text(json.dumps(data, indent=2))
    rows = rows_of(path)
    assert [(r.line, r.record) for r in rows] == [(9, {"q": 1}), (12, {"q": 2})]
    lines = path.read_text().splitlines()
    assert lines[8].strip() == "{" and lines[9].strip() == '"q": 1'


def test_json_invalid_file_names_file_and_line(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n  {"a": 1},\n  {"a": }\n]\n')
    with pytest.raises(DataError) as info:
        rows_of(path)
    assert str(info.value) == f"{path}:3: invalid JSON: Expecting value at column 9"


def test_json_object_without_single_list_is_rejected(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('{"train": [], "test": []}')
    with pytest.raises(DataError) as info:
        rows_of(path)
    assert str(info.value).startswith(f"{path}:1: expected a JSON array of objects")


def test_json_file_holding_json_lines_is_read_as_lines(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('{"a": 1}\n{"a": 2}\n')
    assert [(r.line, r.record) for r in rows_of(path)] == [(1, {"a": 1}), (2, {"a": 2})]


# --- csv, parquet, txt ------------------------------------------------------------------


def test_csv_line_numbers_and_empty_cells(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text(
        "instruction,input,output\n"  # 1
        "Say hi,,Hello\n"  # 2
        '"two\nlines",x,y\n'  # 3-4
        "\n"  # 5
        "short\n"  # 6
        "a,b,c,d\n",  # 7
        encoding="utf-8",
    )
    assert rows_of(path) == [
        RawRow(str(path), 2, {"instruction": "Say hi", "output": "Hello"}, None),
        RawRow(str(path), 3, {"instruction": "two\nlines", "input": "x", "output": "y"}, None),
        RawRow(str(path), 6, {"instruction": "short"}, None),
        RawRow(str(path), 7, None, "invalid CSV: row has 4 cells but the header has 3"),
    ]


def test_parquet_rows_are_numbered_from_one(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    table = pa.table({"query": ["q1", "q2", "q3"], "response": ["r1", None, "r3"]})
    pq.write_table(table, path, row_group_size=2)
    assert rows_of(path) == [
        RawRow(str(path), 1, {"query": "q1", "response": "r1"}, None),
        RawRow(str(path), 2, {"query": "q2", "response": None}, None),
        RawRow(str(path), 3, {"query": "q3", "response": "r3"}, None),
    ]


def test_txt_is_one_text_row(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("Line one.\nLine two.\n", encoding="utf-8")
    assert rows_of(path) == [RawRow(str(path), 1, {"text": "Line one.\nLine two.\n"}, None)]


def test_txt_not_utf8_names_line(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes(b"ok\nok\nbad \xff\n")
    with pytest.raises(DataError) as info:
        rows_of(path)
    assert str(info.value) == f"{path}:3: not UTF-8 text (invalid start byte)"


# --- folders and unsupported files ------------------------------------------------------


def test_directory_reads_supported_files_sorted(tmp_path):
    (tmp_path / "b.jsonl").write_text('{"n": "b"}\n')
    (tmp_path / "a.txt").write_text("doc a")
    (tmp_path / ".hidden.jsonl").write_text('{"n": "hidden"}\n')
    (tmp_path / "sub.json").mkdir()
    rows = rows_of(tmp_path)
    assert [(r.source, r.record) for r in rows] == [
        (f"{tmp_path}/a.txt", {"text": "doc a"}),
        (f"{tmp_path}/b.jsonl", {"n": "b"}),
    ]


@pytest.mark.bad_input(
    input="A dataset folder with subfolders",
    outcome="Every data file is read, subfolders included, in sorted path order",
)
def test_directory_reads_subfolders_in_sorted_path_order(tmp_path):
    (tmp_path / "train" / "part2").mkdir(parents=True)
    (tmp_path / "train" / "part2" / "b.jsonl").write_text('{"n": "deep"}\n')
    (tmp_path / "train" / "a.jsonl").write_text('{"n": "train"}\n')
    (tmp_path / "top.jsonl").write_text('{"n": "top"}\n')
    rows = rows_of(tmp_path)
    assert [(r.source, r.record["n"]) for r in rows] == [
        (f"{tmp_path}/top.jsonl", "top"),
        (f"{tmp_path}/train/a.jsonl", "train"),
        (f"{tmp_path}/train/part2/b.jsonl", "deep"),
    ]


@pytest.mark.bad_input(
    input="A dataset folder holding files swiftlm does not read (notes.md, images ...)",
    outcome="Refused naming each such file (folder-relative) and the supported types",
)
def test_directory_refuses_unreadable_files_by_name(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"n": 1}\n')
    (tmp_path / "notes.md").write_text("about the data")
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "cat.png").write_bytes(b"png")
    with pytest.raises(DataError) as info:
        rows_of(tmp_path)
    assert str(info.value) == (
        f"dataset folder {tmp_path} holds files swiftlm does not read: img/cat.png, notes.md; "
        "supported: .jsonl, .json, .csv, .parquet, .txt. Move them out of the folder, or pass "
        "the data files themselves to --dataset"
    )


@pytest.mark.bad_input(
    input="Hidden files, hidden folders (.git) and dataset cards (README, LICENSE) in a "
    "dataset folder",
    outcome="Passed over as not data, as the folder reader's docstring states",
)
def test_directory_passes_over_hidden_entries_and_dataset_cards(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"n": 1}\n')
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("[core]")
    (tmp_path / ".gitattributes").write_text("*.parquet filter=lfs")
    (tmp_path / "README.md").write_text("# card")
    (tmp_path / "LICENSE").write_text("Apache-2.0")
    assert [r.source for r in rows_of(tmp_path)] == [f"{tmp_path}/data.jsonl"]


def test_directory_without_data_files(tmp_path):
    (tmp_path / "README.md").write_text("x")
    with pytest.raises(DataError) as info:
        rows_of(tmp_path)
    assert "has no data files" in str(info.value)


def test_unsupported_extension_lists_supported_ones(tmp_path):
    path = tmp_path / "d.xlsx"
    path.write_text("x")
    with pytest.raises(DataError) as info:
        rows_of(path)
    assert str(info.value) == (
        f"{path}: unsupported dataset file type '.xlsx'; supported: "
        ".jsonl, .json, .csv, .parquet, .txt"
    )


def test_missing_local_file_is_not_looked_up_on_the_hub(tmp_path):
    path = tmp_path / "missing.jsonl"
    with pytest.raises(DataError) as info:
        rows_of(path)
    assert str(info.value) == f"dataset file not found: {path}"


# --- hub --------------------------------------------------------------------------------


def fake_datasets(monkeypatch, load_dataset):
    module = types.ModuleType("datasets")
    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)


def test_hub_dataset_with_subset(monkeypatch):
    calls = []

    def load_dataset(name, subset, split):
        calls.append((name, subset, split))
        return [{"text": "one"}, {"text": "two"}]

    fake_datasets(monkeypatch, load_dataset)
    rows = list(read_rows("org/corpus:en"))
    assert calls == [("org/corpus", "en", "train")]
    assert rows == [
        RawRow("org/corpus:en", 1, {"text": "one"}, None),
        RawRow("org/corpus:en", 2, {"text": "two"}, None),
    ]


def test_unreachable_hub_dataset(monkeypatch):
    def load_dataset(name, subset, split):
        raise ConnectionError("offline")

    fake_datasets(monkeypatch, load_dataset)
    with pytest.raises(DataError) as info:
        list(read_rows("org/nothing"))
    message = str(info.value)
    assert message.startswith(
        "dataset 'org/nothing' is neither a local file nor reachable on the Hugging Face Hub "
        "(ConnectionError: offline). Check the path"
    )


# --- built-in datasets ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILTIN_DATASETS))
def test_builtin_dataset_names_resolve(name):
    path = builtin_dataset_path(name)
    assert path.name == BUILTIN_DATASETS[name]
    assert path.parent.name == "assets"
    # Every built-in name ships as package data; a missing file is the regression.
    assert path.is_file(), f"packaged asset {path} for {name} is missing from the installed swiftlm"
    rows = list(read_rows(name))
    assert rows, f"{name} is empty"
    assert all(r.source == name and r.error is None for r in rows)
    assert [r.line for r in rows[:2]] == [1, 2]
    assert "messages" in rows[0].record


def test_builtin_dataset_files_are_declared_as_package_data():
    # An editable install reads the assets from src/, so the test above also passes when a
    # wheel would leave them out; this checks the wheel's package-data globs name each one.
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    globs = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["swiftlm"]
    undeclared = [
        name
        for name, file in sorted(BUILTIN_DATASETS.items())
        if not any(fnmatch(f"assets/{file}", glob) for glob in globs)
    ]
    assert undeclared == [], f"not in [tool.setuptools.package-data]: {undeclared}"
