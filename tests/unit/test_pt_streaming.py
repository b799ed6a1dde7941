"""`--streaming true` (data.streaming): the stream's chunks are encode_pretraining's, a
stream resumed from a saved position continues it exactly without reading what came before,
bad rows are named, and the flag's rules are config errors."""

import json
import random

import pytest

from swiftlm.config import TrainConfig, parse_config
from swiftlm.config.commands import UNUSED_FLAGS
from swiftlm.config.rules import Facts, check
from swiftlm.data.encode import encode_pretraining
from swiftlm.data.streaming import StreamChunks, StreamPosition
from swiftlm.errors import ConfigError, DataError


def _texts(count=60, seed=3):
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "stream", "token", "résumé", "東京", "\n"]
    return [f"doc {i}: " + " ".join(rng.choices(words, k=rng.randint(1, 40))) for i in range(count)]


def _corpus(tmp_path, texts):
    """A .jsonl (with a blank line) and a .txt document: the stream is both, in order."""
    path = tmp_path / "a.jsonl"
    lines = [json.dumps({"text": t}, ensure_ascii=False) for t in texts[:-1]]
    lines.insert(5, "")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text(texts[-1], encoding="utf-8")
    return [(path, "a.jsonl"), (tmp_path / "b.txt", "b.txt")]


def _stream(files, tokenizer, length=10_000, max_length=16, **options):
    return StreamChunks(files, tokenizer, max_length, length, log=lambda line: None, **options)


def test_the_stream_is_encode_pretrainings_chunks_in_file_order_pass_after_pass(
    tmp_path, tiny_tokenizer
):
    texts = _texts()
    files = _corpus(tmp_path, texts)
    # Two passes joined with EOS: the second pass carries on the chunk the first one ended in.
    expected, _ = encode_pretraining(tiny_tokenizer, texts * 2, 16)
    full = [c for c in expected if len(c["input_ids"]) == 16]
    stream = _stream(files, tiny_tokenizer)
    got = [stream[i] for i in range(len(full))]
    assert got == full
    assert stream.position_at(len(full)).passes == 1


def test_a_resumed_stream_continues_exactly_and_reads_nothing_before_its_position(
    tmp_path, tiny_tokenizer
):
    files = _corpus(tmp_path, _texts(count=400))
    first = _stream(files, tiny_tokenizer)
    reference = [first[i] for i in range(60)]
    for index in (1, 7, 23, 41):  # starts inside documents and at their first token
        position = first.position_at(index)
        again = _stream(files, tiny_tokenizer)
        again.seek(index, StreamPosition.from_json(json.loads(json.dumps(position.as_json()))))
        assert [again[i] for i in range(index, 60)] == reference[index:]
        # The reader's first read is at the saved byte offset of the chunk's document.
        assert again.reader.first_seek == (position.file, position.offset)
        assert position.offset > 0 or index == 1  # chunk 1 starts inside the first document
    assert any(first.position_at(i).token > 0 for i in (1, 7, 23, 41))  # mid-document too


def test_a_shuffle_buffer_permutes_windows_and_resumes_inside_one(tmp_path, tiny_tokenizer):
    files = _corpus(tmp_path, _texts(count=400))
    plain = _stream(files, tiny_tokenizer)
    in_order = [plain[i]["input_ids"] for i in range(40)]
    shuffled = _stream(files, tiny_tokenizer, shuffle_buffer_size=8, seed=1)
    got = [shuffled[i]["input_ids"] for i in range(40)]
    for start in range(0, 40, 8):  # each window holds the same chunks, in another order
        assert sorted(got[start : start + 8]) == sorted(in_order[start : start + 8])
    assert got != in_order
    other_seed = _stream(files, tiny_tokenizer, shuffle_buffer_size=8, seed=2)
    assert [other_seed[i]["input_ids"] for i in range(8)] != got[:8]
    for index in (5, 8, 19):  # inside a window, at its start
        again = _stream(files, tiny_tokenizer, shuffle_buffer_size=8, seed=1)
        again.seek(index, shuffled.position_at(index))
        assert [again[i]["input_ids"] for i in range(index, 40)] == got[index:]
        window_start = plain.position_at(index - index % 8)  # re-read from the window's start
        assert again.reader.first_seek == (window_start.file, window_start.offset)


def test_reading_out_of_order_is_an_internal_error(tmp_path, tiny_tokenizer):
    stream = _stream(_corpus(tmp_path, _texts()), tiny_tokenizer)
    stream[0]
    with pytest.raises(RuntimeError, match="out of order.*chunk 0 asked, chunk 1 is next"):
        stream[0]


@pytest.mark.bad_input(
    input="A streamed .jsonl line that is not JSON, or not UTF-8",
    outcome="A data error naming file:line and the fix (or, with --skip_bad_rows true, the "
    "row is skipped, named in the log and counted)",
)
@pytest.mark.parametrize("bad", [b"{not json", b'{"text": "caf\xe9"}'])
def test_a_bad_line_is_named_by_file_and_line(tmp_path, tiny_tokenizer, bad):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "one"}\n{"text": "two"}\n' + bad + b'\n{"text": "three"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:3: invalid JSON.*--skip_bad_rows"):
        _stream([(path, "d.jsonl")], tiny_tokenizer, max_length=4)[0]
    logged = []
    stream = StreamChunks([(path, "d.jsonl")], tiny_tokenizer, 4, 100, skip_bad_rows=True,
                          log=logged.append)  # fmt: skip
    stream[0]
    assert stream.reader.skipped >= 1 and logged[0].startswith("streaming: skipped d.jsonl:3")


def _train(*flags) -> TrainConfig:
    argv = ["--dataset", "d.jsonl", "--streaming", "true", *map(str, flags)]
    return parse_config(TrainConfig, argv, "swiftlm pt")


@pytest.mark.bad_input(
    input="--streaming true with flags it cannot honour (no --max_steps, --packing, a token "
    "budget, --split_dataset_ratio, `#N` sampling, several processes, an automatic batch size)",
    outcome="A config error before anything loads, naming the flag and the fix",
)
@pytest.mark.parametrize(
    "flags, world, message",
    [
        ((), 1, "--streaming true.*give the run's length with --max_steps N"),
        (("--max_steps", 5, "--packing", "true"), 1, "drop --packing"),
        (("--max_steps", 5, "--max_tokens_per_batch", 4096), 1, "--max_tokens_per_batch"),
        (("--max_steps", 5, "--split_dataset_ratio", 0.1), 1, "--val_dataset instead"),
        (("--max_steps", 5), 2, "this job has 2: use --nproc_per_node 1"),
        (("--max_steps", 5, "--per_device_train_batch_size", "auto"), 1, "not auto"),
        (("--max_steps", 5, "--dataset", "e.jsonl#20"), 1, r"e\.jsonl#20: `#N`"),
    ],
)
def test_streaming_flag_rules(flags, world, message):
    with pytest.raises(ConfigError, match=message):
        check(_train(*flags), Facts(world_size=world))


@pytest.mark.bad_input(
    input="--shuffle_buffer_size without --streaming true",
    outcome="A config error naming both flags",
)
def test_a_shuffle_buffer_needs_streaming():
    cfg = parse_config(TrainConfig, ["--dataset", "d.jsonl", "--shuffle_buffer_size", "9"], "pt")
    with pytest.raises(ConfigError, match="--shuffle_buffer_size shuffles a stream"):
        check(cfg, Facts())


def test_a_valid_streaming_config_passes():
    check(_train("--max_steps", 5), Facts(world_size=1))


@pytest.mark.bad_input(
    input="--streaming given to swiftlm sft",
    outcome="A config error: the flag is not used by sft",
)
def test_sft_refuses_streaming():
    with pytest.raises(ConfigError, match="streaming"):
        parse_config(TrainConfig, ["--streaming", "true"], "swiftlm sft", "", UNUSED_FLAGS["sft"])
