"""Token shards of `swiftlm pt` (data.token_shards): the same chunks as the in-memory
encoding, identical shards from any number of workers, atomic and reusable cache entries,
bad rows named by file:line, reads that touch only the chunks asked for."""

import json
import random

import pytest

from swiftlm.data import token_shards
from swiftlm.data.encode import encode_pretraining
from swiftlm.data.formats import text_sample
from swiftlm.data.loading import DataValidationError, load_samples
from swiftlm.data.token_shards import load_or_build_shards, plan_pieces, shard_cache_folder
from swiftlm.train.batching import DataPosition, build_batch_plan, iterate_steps

WORDS = [
    "the",
    "of",
    "and",
    "model",
    "data",
    "token",
    "shard",
    "memory",
    "résumé",
    "naïve",
    "東京",
    "😀",
    "\t",
    "tab",
]


def _corpus(folder, documents=240, seed=0):
    """A JSON Lines file (BOM, blank lines, unicode) and a .txt file, in a folder."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(documents):
        words = rng.choices(WORDS, k=rng.randint(1, 120))
        text = f"doc{i} " + " ".join(words)
        lines.append(json.dumps({"text": text, "id": i}, ensure_ascii=i % 2 == 0))
        if i % 37 == 5:
            lines.append("   ")  # blank lines are passed over, as by the generic loader
    (folder / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    (folder / "b.txt").write_text("A whole file is one document.\nSecond line.\n")
    return folder


def _reference(specs, tokenizer, max_length):
    samples, _ = load_samples(specs, text_sample)
    return encode_pretraining(tokenizer, [s["text"] for s in samples], max_length)


def _build(specs, tokenizer, max_length, **options):
    lines = []
    chunks = load_or_build_shards(specs, tokenizer, max_length, lines.append, **options)
    return chunks, lines


@pytest.mark.parametrize("max_length", [2, 17, 64])
def test_chunks_equal_the_in_memory_encoding(tiny_tokenizer, tmp_path, max_length):
    folder = _corpus(tmp_path / "corpus")
    specs = [str(folder), str(folder / "a.jsonl")]
    # Small pieces: many shards, chunks that span two of them, lines cut at every boundary.
    assert len(plan_pieces(specs, piece_bytes=1500)) > 10
    chunks, _ = _build(specs, tiny_tokenizer, max_length, piece_bytes=1500, rebuild=True)
    expected, dropped = _reference(specs, tiny_tokenizer, max_length)
    assert len(chunks) == len(expected) and chunks.dropped == dropped
    assert [chunks[i] for i in range(len(chunks))] == expected
    assert chunks.lengths == [len(c["input_ids"]) for c in expected]
    tokens = sum(chunks.lengths)
    assert chunks.label_counts == (tokens, tokens, len(expected))


def test_two_workers_write_the_same_shards_as_one(tiny_tokenizer, tmp_path, monkeypatch):
    folder = _corpus(tmp_path / "corpus", documents=400)
    specs = [str(folder)]
    one, _ = _build(specs, tiny_tokenizer, 32, piece_bytes=2000, rebuild=True)
    one_bytes = b"".join(p.read_bytes() for p in sorted(one.folder.glob("shard-*.bin")))
    two, lines = _build(specs, tiny_tokenizer, 32, piece_bytes=2000, rebuild=True, workers=2)
    two_bytes = b"".join(p.read_bytes() for p in sorted(two.folder.glob("shard-*.bin")))
    assert one_bytes == two_bytes and len(one_bytes) > 10_000
    assert "with 2 workers" in lines[-2] and "tokens/s" in lines[-2]


def test_an_interrupted_build_leaves_no_entry(tiny_tokenizer, tmp_path, monkeypatch):
    specs = [str(_corpus(tmp_path / "corpus"))]
    real, calls = token_shards.tokenize_piece, []

    def failing(piece, *args):
        calls.append(piece)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a Ctrl-C in the middle of the corpus
        return real(piece, *args)

    monkeypatch.setattr(token_shards, "tokenize_piece", failing)
    with pytest.raises(KeyboardInterrupt):
        _build(specs, tiny_tokenizer, 32, piece_bytes=1500, rebuild=True)
    folder = shard_cache_folder(specs, tiny_tokenizer, False)
    assert not folder.exists()
    assert not list(folder.parent.glob(f"{folder.name}*"))  # no partial folder either


def test_a_cached_rerun_reads_the_shards_without_tokenizing(tiny_tokenizer, tmp_path, monkeypatch):
    specs = [str(_corpus(tmp_path / "corpus"))]
    first, _ = _build(specs, tiny_tokenizer, 32, rebuild=True)

    def must_not_run(*args):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(token_shards, "tokenize_piece", must_not_run)
    again, lines = _build(specs, tiny_tokenizer, 32)
    assert [again[i] for i in range(len(again))] == [first[i] for i in range(len(first))]
    assert "token shards loaded from cache" in lines[-1]
    # The shards hold the token stream: another --max_length cuts the same entry anew.
    other, _ = _build(specs, tiny_tokenizer, 50)
    assert other.folder == first.folder and other[0]["input_ids"] == first.tokens(0, 50).tolist()


@pytest.mark.bad_input(
    input="A pre-training corpus with rows that are not text (invalid JSON, a non-string "
    "`text`, a JSON array) deep inside a large file tokenized in pieces",
    outcome="A data error listing each bad row as file:line: reason (line numbers of the whole "
    "file), before any entry is written; --skip_bad_rows skips and counts them",
)
def test_bad_rows_are_named_by_file_and_line(tiny_tokenizer, tmp_path):
    rows = [json.dumps({"text": f"document {i} " * 20}) for i in range(300)]
    rows[150] = json.dumps({"text": 5})
    rows[201] = "{not json"
    rows[250] = "[1, 2]"
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(DataValidationError) as raised:
        _build([str(path)], tiny_tokenizer, 32, piece_bytes=1000, rebuild=True)
    message = str(raised.value)
    assert f"{path}:151: 'text' must be a string, got int" in message
    assert f"{path}:202: invalid JSON" in message
    assert f"{path}:251: expected a JSON object" in message
    assert "3 of 300 rows are invalid" in message
    assert not shard_cache_folder([str(path)], tiny_tokenizer, False).exists()
    chunks, lines = _build([str(path)], tiny_tokenizer, 32, skip_bad_rows=True, piece_bytes=1000)
    assert chunks.label_counts[0] > 0 and "skipped 3 bad rows" in lines[0]


def test_a_step_reads_only_its_own_chunks_wherever_it_resumes(tiny_tokenizer, tmp_path):
    """Constant-time resume: the first step after a resume at 60% of the epoch reads the
    chunks of that step and nothing else (no replay of consumed data)."""
    chunks, _ = _build([str(_corpus(tmp_path / "corpus", 600))], tiny_tokenizer, 16)
    plan = build_batch_plan(chunks.lengths, batch_size=4, dp_size=1, seed=3)
    read = []
    real_tokens = chunks.tokens
    chunks.tokens = lambda start, stop: read.append(start // 16) or real_tokens(start, stop)
    for fraction in (0.0, 0.6, 0.9):
        position = DataPosition(0, int(fraction * len(plan.epoch_batches(0))))
        step, _ = next(iterate_steps(plan, 2, position))
        read.clear()
        wanted = [index for batch in step for row in batch[0] for index in row]
        samples = [chunks[i] for i in wanted]
        assert sorted(read) == sorted(wanted) and len(samples) == 8


def test_a_resume_finds_its_entry_without_hashing_the_corpus_again(
    tiny_tokenizer, tmp_path, monkeypatch
):
    """File digests are remembered by (size, time): a later run stats the corpus instead of
    reading it; an edited file is hashed again and gets a new entry."""
    import hashlib

    from swiftlm.data import corpus_key

    specs = [str(_corpus(tmp_path / "corpus"))]
    first = shard_cache_folder(specs, tiny_tokenizer, False)
    hashed = []
    real = hashlib.file_digest
    monkeypatch.setattr(
        corpus_key.hashlib, "file_digest", lambda f, name: hashed.append(f.name) or real(f, name)
    )
    assert shard_cache_folder(specs, tiny_tokenizer, False) == first and hashed == []
    with (tmp_path / "corpus" / "a.jsonl").open("a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    assert shard_cache_folder(specs, tiny_tokenizer, False) != first
    assert hashed == [str(tmp_path / "corpus" / "a.jsonl")]


def test_sources_that_cannot_be_sharded_are_named(tmp_path):
    data = tmp_path / "a.jsonl"
    data.write_text('{"text": "x"}\n')
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "b.parquet").write_bytes(b"")
    assert token_shards.shard_blocker([str(data), str(data)]) is None
    assert "`#N` sampling" in token_shards.shard_blocker([f"{data}#5"])
    assert "not a local file" in token_shards.shard_blocker(["some-org/some-dataset"])
    assert "b.parquet" in token_shards.shard_blocker([str(tmp_path / "mixed")])


def test_the_prefetcher_keeps_order_raises_errors_in_place_and_stops():
    import threading

    from swiftlm.data.prefetch import Prefetcher

    assert list(Prefetcher(iter(range(50)), lambda x: x * x)) == [x * x for x in range(50)]

    def fails_at_three(x):
        if x == 3:
            raise ValueError("bad item 3")
        return x

    items = Prefetcher(iter(range(10)), fails_at_three)
    assert [next(items) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="bad item 3"):
        next(items)
    endless = Prefetcher(iter(int, 1), lambda x: x)  # never exhausted: close() must stop it
    next(endless)
    endless.close()
    assert not any(t.name == "swiftlm-prefetch" and t.is_alive() for t in threading.enumerate())


@pytest.mark.bad_input(
    input="A .txt document that is not UTF-8 in a corpus tokenized by 2 worker processes",
    outcome="A data error naming file:line and the decoding problem, raised from the worker "
    "in the main process; no entry is written",
)
def test_a_worker_error_names_the_file_and_leaves_no_entry(tiny_tokenizer, tmp_path):
    from swiftlm.errors import DataError

    folder = _corpus(tmp_path / "corpus", documents=300)
    (folder / "c.txt").write_bytes(b"fine line\nbad \xff byte\n")
    with pytest.raises(DataError, match=r"c\.txt:2: not UTF-8 text"):
        _build([str(folder)], tiny_tokenizer, 32, piece_bytes=2000, rebuild=True, workers=2)
    entry = shard_cache_folder([str(folder)], tiny_tokenizer, False)
    assert not list(entry.parent.glob(f"{entry.name}*"))
