"""The streaming SFT data path (data.selection, data.stream_encode): the same samples in the
same order as the in-memory path (mixing, #N, splits, bad rows), identical cache entries,
and memory bounded by a chunk."""

import json
import tracemalloc
from types import SimpleNamespace

import pyarrow as pa
import pytest

from conftest import write_jsonl
from swiftlm.config import UNUSED_FLAGS, TrainConfig, parse_config
from swiftlm.data import stream_encode
from swiftlm.data.cache import record_batch
from swiftlm.data.encode import TruncationReport
from swiftlm.data.formats import chat_sample
from swiftlm.data.loading import (
    MAX_KEPT_BAD_ROWS,
    DataValidationError,
    LoadReport,
    load_samples,
    split_samples,
)
from swiftlm.data.selection import Selection, iter_samples, select, split_selection
from swiftlm.errors import DataError
from swiftlm.monitor.data_health import count_labels
from swiftlm.train.prepare import load_splits, prepare_data


def chat(i: int, words: int = 1) -> dict:
    answer = " ".join(f"answer{i}" for _ in range(words))
    return {
        "messages": [
            {"role": "user", "content": f"question {i}?"},
            {"role": "assistant", "content": answer},
        ],
        "id": i,  # a column sft does not read: counted in the notices
    }


def datasets(folder):
    """Three files with bad rows (an empty answer, invalid JSON) among varied conversations."""
    a = [chat(i, 1 + i % 7) for i in range(30)]
    a[4] = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}
    b = [chat(100 + i, 1 + i % 3) for i in range(11)]
    c = [chat(200 + i, 2 + i % 11) for i in range(17)] + ["{not json"]
    return [
        str(write_jsonl(folder / "a.jsonl", a)),
        str(write_jsonl(folder / "b.jsonl", b)),
        str(write_jsonl(folder / "c.jsonl", c)),
    ]


def streamed(specs, ratio=0.0, seed=7, skip=True):
    report = LoadReport()
    selection = select(specs, chat_sample, report, skip_bad_rows=skip, seed=seed)
    train, val = split_selection(selection, ratio, seed)
    return list(iter_samples(train, chat_sample)), list(iter_samples(val, chat_sample)), report


def in_memory(specs, ratio=0.0, seed=7, skip=True):
    samples, report = load_samples(specs, chat_sample, skip_bad_rows=skip, seed=seed)
    train, val = split_samples(samples, ratio, seed)
    return train, val, report


@pytest.mark.parametrize(
    "picks",
    [
        ("a", "b", "c"),  # plain mixing
        ("a#12", "b#50", "c"),  # a subset; oversampling (4 passes over b, then a remainder)
        ("c#3", "a#29", "b#11"),  # #N at and under the size
        ("b#23", "b#5"),  # the same file twice, sampled with different seeds
    ],
)
@pytest.mark.parametrize("ratio", [0.0, 0.2])
def test_selection_gives_the_in_memory_samples_in_order(tmp_path, picks, ratio):
    a, b, c = datasets(tmp_path)
    files = {"a": str(a), "b": str(b), "c": str(c)}
    specs = [files[p[0]] + p[1:] for p in picks]
    train, val, report = streamed(specs, ratio)
    want_train, want_val, want_report = in_memory(specs, ratio)
    assert [s["source"] for s in train] == [s["source"] for s in want_train]
    assert train == want_train and val == want_val
    assert bool(val) == (ratio > 0)
    assert report.samples == want_report.samples and report.skipped == want_report.skipped
    assert report.notices("sft") == want_report.notices("sft")
    if {"a", "c"} <= {p[0] for p in picks}:
        assert report.summary() == "skipped 2 bad rows: 1 empty assistant answer, 1 invalid JSON"


@pytest.mark.bad_input(
    input="bad rows in a dataset large enough to be streamed (text SFT)",
    outcome="The same `file:line: reason` list as the in-memory path, counting every bad row; "
    "only the first 1000 messages are kept in memory",
)
def test_bad_rows_stop_the_streamed_path_with_the_same_message(tmp_path):
    specs = datasets(tmp_path)
    with pytest.raises(DataValidationError) as got:
        streamed(specs, skip=False)
    with pytest.raises(DataValidationError) as want:
        in_memory(specs, skip=False)
    assert str(got.value) == str(want.value)
    assert f"{specs[0]}:5: " in str(got.value) and f"{specs[2]}:18: invalid JSON" in str(got.value)


def test_bad_row_messages_kept_are_bounded_but_all_are_counted(tmp_path):
    bad = MAX_KEPT_BAD_ROWS + 500
    data = write_jsonl(tmp_path / "bad.jsonl", ["{oops"] * bad + [chat(1)])
    with pytest.raises(DataValidationError) as error:
        select([str(data)], chat_sample, LoadReport(), skip_bad_rows=False, seed=1)
    assert len(error.value.bad_rows) == MAX_KEPT_BAD_ROWS
    message = str(error.value)
    assert f"... and {bad - 20} more" in message
    assert f"{bad} of {bad + 1} rows are invalid" in message
    report = LoadReport()
    select([str(data)], chat_sample, report, skip_bad_rows=True, seed=1)
    assert report.skipped == {"invalid JSON": bad} and len(report.bad_rows) == MAX_KEPT_BAD_ROWS


def test_no_valid_rows_is_the_same_error(tmp_path):
    data = write_jsonl(tmp_path / "bad.jsonl", ["{oops"])
    with pytest.raises(DataError, match="no valid samples in dataset"):
        streamed([str(data)])


def _config(model_dir, specs, *flags):
    argv = ["--model", str(model_dir), "--dataset", *map(str, specs), *flags]
    return parse_config(TrainConfig, argv, "swiftlm sft", unused=UNUSED_FLAGS["sft"])


def _in_memory_entry(cfg, method):
    """What the in-memory path encodes: load_splits, then the method's encode per split."""
    lines = []
    train, val = load_splits(cfg, method, lines.append)
    encoded = {name: method.encode(s) for name, s in (("train", train), ("val", val)) if s}
    return encoded, lines


def _rows(samples, columns):
    return [{name: samples[i][name] for name in columns} for i in range(len(samples))]


FLAGS = [
    ("--max_length", "24", "--truncation_strategy", "left", "--split_dataset_ratio", "0.25"),
    ("--max_length", "36", "--truncation_strategy", "delete", "--skip_bad_rows", "true"),
]


@pytest.mark.parametrize("flags", FLAGS)
def test_streamed_entry_equals_the_in_memory_encoding(
    tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch, flags
):
    from swiftlm.methods.sft import SFT

    monkeypatch.setattr(stream_encode, "ROWS_PER_CHUNK", 5)  # many record batches per split
    a, b, c = datasets(tmp_path)
    clean = write_jsonl(tmp_path / "clean.jsonl", [chat(i, 1 + i % 9) for i in range(40)])
    specs = [f"{a}#20", f"{b}#30", c] if "--skip_bad_rows" in flags else [clean, f"{clean}#9"]
    cfg = _config(tiny_model_dir, specs, *flags)
    method = SFT(cfg, tiny_tokenizer)
    want, want_lines = _in_memory_entry(cfg, method)
    ctx = SimpleNamespace(is_main=True, broadcast_object=lambda value: value)
    lines = []
    train, val, truncation = prepare_data(cfg, method, tiny_tokenizer, ctx, lines.append)
    assert train.table.to_batches()[0].num_rows <= 5 < len(train)  # written chunk by chunk
    assert _rows(train, method.columns) == _rows(want["train"].samples, method.columns)
    assert train.lengths == [len(s["input_ids"]) for s in want["train"].samples]
    assert truncation["train"] == want["train"].truncation
    assert truncation["train"]["truncated" if "left" in flags else "deleted"] > 0
    if "val" in want:
        assert _rows(val, method.columns) == _rows(want["val"].samples, method.columns)
        assert truncation["val"] == want["val"].truncation
    else:
        assert val == [] and truncation["val"] == {}
    assert train.label_counts == count_labels(want["train"].samples, method.columns)
    expected = want_lines + [line for r in want.values() for line in r.log]
    assert lines[: len(expected)] == expected
    assert any(" rows/s, " in line and " tokens/s" in line for line in lines)


def test_worker_processes_write_the_same_entry(tiny_model_dir, tiny_tokenizer, tmp_path):
    """--dataset_num_proc 2: chunks encoded in spawned workers, written in order."""
    from swiftlm.methods.sft import SFT

    data = write_jsonl(tmp_path / "d.jsonl", [chat(i, 1 + i % 13) for i in range(60)])
    cfg = _config(tiny_model_dir, [data], "--max_length", "64", "--split_dataset_ratio", "0.1")
    method = SFT(cfg, tiny_tokenizer)
    selections = stream_encode.select_splits(
        stream_encode.DataOptions([str(data)], [], False, 42, 0.1), method.to_sample, "sft", print
    )
    job = stream_encode.ChunkJob(
        method.chunk_encoder(), method.columns, method.length, (["labels"], ["input_ids"])
    )
    entries = {}
    for workers in (1, 2):
        folder = tmp_path / f"w{workers}"
        folder.mkdir()
        _, lines, stats = stream_encode.encode_splits(
            selections, folder, method.to_sample, job, workers=workers, chunk_rows=7
        )
        tables = {
            n: pa.ipc.open_file(str(folder / f"{n}.arrow")).read_all() for n in stats["labels"]
        }
        entries[workers] = (tables, stats)
        assert f"with {'2 processes' if workers == 2 else '1 process'}: " in lines[-1]
    assert entries[1][1] == entries[2][1]
    for name, table in entries[1][0].items():
        assert table.equals(entries[2][0][name]) and table.num_rows > 0


def _traced_peak(function) -> int:
    tracemalloc.start()
    try:
        function()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_is_bounded_by_a_chunk_not_the_dataset(tmp_path, monkeypatch):
    """Four times the rows: the streamed path's peak stays flat, the in-memory one grows."""
    monkeypatch.setattr(stream_encode, "ROWS_PER_CHUNK", 100)

    class Encoder:  # ids like a tokenizer's, without its cost
        def new_report(self):
            return TruncationReport("right", 10**6)

        def encode(self, samples, report):
            ids = [len(s["messages"][1]["content"]) + i for s in samples for i in range(50)]
            return [{"input_ids": ids[:50], "labels": ids[:50]} for _ in samples]

    job = stream_encode.ChunkJob(Encoder(), ("input_ids", "labels"), _length, ([], []))
    peaks = {}
    for rows in (100, 1000, 4000):  # the first: imports and caches, not measured
        data = write_jsonl(tmp_path / f"{rows}.jsonl", [chat(i, 20) for i in range(rows)])
        selection = select([str(data)], chat_sample, LoadReport(), skip_bad_rows=False, seed=1)
        folder = tmp_path / f"out{rows}"
        folder.mkdir()
        splits = {"train": selection, "val": Selection([])}

        def stream(splits=splits, folder=folder):
            stream_encode.encode_splits(splits, folder, chat_sample, job)

        def whole(data=data):  # the in-memory path: every sample, every encoding, one table
            samples, _ = load_samples([str(data)], chat_sample)
            record_batch(Encoder().encode(samples, None), job.columns, _length, "train")

        peaks[rows] = (_traced_peak(stream), _traced_peak(whole))
        table = pa.ipc.open_file(str(folder / "train.arrow")).read_all()
        assert table.num_rows == rows and table.to_batches()[0].num_rows == 100
    (small_stream, small_whole), (large_stream, large_whole) = peaks[1000], peaks[4000]
    assert large_whole > 3 * small_whole  # the old path grows with the rows
    assert large_stream < 1.5 * small_stream  # the streamed one does not
    assert large_stream < large_whole / 4


def _length(sample: dict) -> int:
    return len(sample["input_ids"])


def test_a_changed_file_between_passes_is_an_error(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [chat(i) for i in range(5)])
    selection = select([str(data)], chat_sample, LoadReport(), skip_bad_rows=False, seed=1)
    write_jsonl(data, [chat(i) for i in range(3)])
    with pytest.raises(DataError, match="changed while it was read"):
        list(iter_samples(selection, chat_sample))


def test_selection_keeps_only_counts(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [chat(i) for i in range(50)])
    selection = select([f"{data}#120"], chat_sample, LoadReport(), skip_bad_rows=False, seed=3)
    assert len(selection) == 120
    assert selection.parts[0].picks.dtype.kind == "i"  # indices, no rows
    assert json.dumps([int(i) for i in selection.parts[0].picks[:50]]) == json.dumps(
        list(range(50))
    )


def test_uncached_runs_stream_too_and_keep_no_entry(
    tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch
):
    """--load_from_cache_file false: the same samples, written to a private folder that is
    removed once read back (memory-mapped), so the cache root keeps nothing."""
    from swiftlm.methods.sft import SFT

    data = write_jsonl(tmp_path / "d.jsonl", [chat(i, 1 + i % 5) for i in range(12)])
    cfg = _config(tiny_model_dir, [data], "--max_length", "64", "--load_from_cache_file", "false")
    method = SFT(cfg, tiny_tokenizer)
    root = tmp_path / "cache-root"
    monkeypatch.setenv("SWIFTLM_DATA_CACHE", str(root))
    ctx = SimpleNamespace(is_main=False, broadcast_object=pytest.fail)  # each rank encodes
    train, _, _ = prepare_data(cfg, method, tiny_tokenizer, ctx, print)
    want, _ = _in_memory_entry(cfg, method)
    assert _rows(train, method.columns) == _rows(want["train"].samples, method.columns)
    assert list(root.iterdir()) == []
