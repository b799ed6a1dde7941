"""The tokenized-data cache: any declared columns round-trip, lengths, atomic entries, replay."""

import pyarrow as pa
import pytest

from swiftlm.data import cache
from swiftlm.data.cache import ArrowSamples, load_or_encode, sample_lengths

COLUMNS = ("input_ids", "labels", "weight", "name", "images", "spans")

TRAIN = [
    {
        "input_ids": [1, 2, 3],
        "labels": [-100, 2, 3],
        "weight": 0.25,
        "name": "first",
        "images": ["a.png", "b.png"],
        "spans": [[0, 1], [2]],
        "source": "d.jsonl:1",  # not declared: not stored
    },
    {
        "input_ids": [4],
        "labels": [4],
        "weight": 1.0,
        "name": "",
        "images": [],
        "spans": [],
    },
    {
        "input_ids": [5, 6],
        "labels": [-100, -100],
        "weight": -3.5,
        "name": "émoji ✓",
        "images": ["c.png"],
        "spans": [[], [7, 8, 9]],
    },
]


def declared(samples):
    return [{name: sample[name] for name in COLUMNS} for sample in samples]


def n_tokens(sample):
    return len(sample["input_ids"])


class Encoder:
    """An `encode` callable that counts its calls."""

    def __init__(self, splits, lines=("2 samples truncated",)):
        self.splits, self.lines, self.calls = splits, list(lines), 0

    def __call__(self):
        self.calls += 1
        return self.splits, self.lines


def load(folder, encode, log=None, columns=COLUMNS):
    return load_or_encode(
        folder, encode, log or (lambda line: None), columns=columns, length=n_tokens
    )


def test_mixed_columns_round_trip(tmp_path):
    encode = Encoder({"train": TRAIN, "val": TRAIN[1:2]})
    first = load(tmp_path / "entry", encode)
    again = load(tmp_path / "entry", encode)
    assert encode.calls == 1
    for splits in (first, again):
        assert isinstance(splits["train"], ArrowSamples)
        assert list(splits["train"]) == declared(TRAIN)
        assert list(splits["val"]) == declared(TRAIN[1:2])
        assert splits["train"][-1] == declared(TRAIN)[-1]
        assert splits["train"][1:] == declared(TRAIN[1:])
    schema = again["train"].table.schema
    assert schema.field("input_ids").type == pa.list_(pa.int32())
    assert schema.field("spans").type == pa.list_(pa.list_(pa.int32()))
    assert schema.field("weight").type == pa.float64()
    assert schema.field("name").type == pa.string()
    assert schema.field("images").type == pa.list_(pa.string())


def test_lengths_are_stored_and_counted(tmp_path):
    splits = load(tmp_path / "entry", Encoder({"train": TRAIN}))
    assert splits["train"].lengths == [3, 1, 2]
    assert sample_lengths(splits["train"], lambda s: 1 / 0) == [3, 1, 2]  # the stored column
    assert sample_lengths(TRAIN, n_tokens) == [3, 1, 2]
    assert sample_lengths(TRAIN, lambda s: 2 * len(s["labels"])) == [6, 2, 4]


def test_empty_split_and_all_empty_lists(tmp_path):
    samples = [{"ids": [], "tags": []}, {"ids": [], "tags": []}]
    encode = Encoder({"train": samples, "val": []})
    splits = load_or_encode(
        tmp_path / "entry", encode, print, columns=("ids", "tags"), length=lambda s: 0
    )
    assert list(splits["train"]) == samples
    assert len(splits["val"]) == 0 and list(splits["val"]) == []


def test_integers_beyond_int32_are_kept_exact(tmp_path):
    samples = [{"ids": [2**40, 1]}, {"ids": [3]}]
    splits = load_or_encode(
        tmp_path / "entry", Encoder({"train": samples}), print, columns=("ids",), length=len
    )
    assert list(splits["train"]) == samples
    assert splits["train"].table.schema.field("ids").type == pa.list_(pa.int64())


def test_cache_hit_replays_the_log_lines(tmp_path):
    encode = Encoder({"train": TRAIN}, lines=["skipped 1 bad row: 1 invalid JSON", "3 truncated"])
    first, second = [], []
    load(tmp_path / "entry", encode, first.append)
    load(tmp_path / "entry", encode, second.append)
    assert encode.calls == 1
    assert first[:2] == second[:2] == ["skipped 1 bad row: 1 invalid JSON", "3 truncated"]
    assert first[2].startswith("tokenized data in ")
    assert second[2].startswith("tokenized data loaded from cache in ")
    assert len(first) == len(second) == 3


def test_failed_write_leaves_no_entry(tmp_path, monkeypatch):
    folder = tmp_path / "entry"
    real_write = cache._write_arrow

    def write_then_fail(path, samples, columns, length, split):
        real_write(path, samples, columns, length, split)
        if split == "val":
            raise OSError("disk full")

    monkeypatch.setattr(cache, "_write_arrow", write_then_fail)
    encode = Encoder({"train": TRAIN, "val": TRAIN[:1]})
    with pytest.raises(OSError, match="disk full"):
        load(folder, encode)
    assert list(tmp_path.iterdir()) == []  # neither the entry nor its partial folder
    monkeypatch.setattr(cache, "_write_arrow", real_write)
    assert list(load(folder, encode)["val"]) == declared(TRAIN[:1])
    assert encode.calls == 2


def test_interrupted_write_is_not_an_entry(tmp_path):
    # A run killed mid-write leaves only its partial folder, which is never read.
    (tmp_path / "entry.partial-12345").mkdir()
    (tmp_path / "entry.partial-12345" / "train.arrow").write_bytes(b"half")
    encode = Encoder({"train": TRAIN})
    assert list(load(tmp_path / "entry", encode)["train"]) == declared(TRAIN)
    assert encode.calls == 1


def test_unreadable_entry_is_rebuilt(tmp_path):
    folder = tmp_path / "entry"
    encode = Encoder({"train": TRAIN})
    load(folder, encode)
    (folder / "train.arrow").write_bytes(b"not arrow")
    lines = []
    assert list(load(folder, encode, lines.append)["train"]) == declared(TRAIN)
    assert encode.calls == 2
    assert lines[0].startswith(f"tokenized-data cache entry {folder} is unreadable")
    assert lines[0].endswith("; re-tokenizing")


def test_entry_with_other_columns_is_rebuilt(tmp_path):
    folder = tmp_path / "entry"
    encode = Encoder({"train": TRAIN})
    load(folder, encode, columns=("input_ids", "labels"))
    lines = []
    splits = load(folder, encode, lines.append)
    assert encode.calls == 2
    assert list(splits["train"]) == declared(TRAIN)
    assert "holds columns ('input_ids', 'labels')" in lines[0]


def test_declared_column_missing_from_a_sample(tmp_path):
    with pytest.raises(ValueError) as info:
        load(tmp_path / "entry", Encoder({"train": [{"input_ids": [1]}]}))
    assert str(info.value) == (
        "an encoded sample of split 'train' has no column 'labels'; the method declares "
        f"columns {COLUMNS}"
    )
    assert not (tmp_path / "entry").exists()


def test_column_with_mixed_types_is_named(tmp_path):
    samples = [{"x": [1]}, {"x": "one"}]
    with pytest.raises(ValueError, match="column 'x' of split 'train' mixes value types"):
        load_or_encode(
            tmp_path / "entry", Encoder({"train": samples}), print, columns=("x",), length=len
        )


def test_length_column_name_is_reserved(tmp_path):
    with pytest.raises(ValueError, match="'length' is reserved"):
        load_or_encode(tmp_path / "entry", Encoder({}), print, columns=("length",), length=len)
