"""`swiftlm pt --streaming true` trains on the chunks of the in-memory encoding in file
order, and a resumed streaming run equals an uninterrupted one, reading from the saved byte
offset on (never the documents it already trained on)."""

import json

import pytest

from conftest import run_pt, stopped_at, text_corpus
from swiftlm.cli.main import main
from swiftlm.data.streaming import DocumentReader, StreamPosition
from swiftlm.train import prepare, run
from tolerance import assert_same_weights


def test_streaming_trains_on_the_in_memory_chunks_in_file_order(
    tiny_model_dir, tmp_path, monkeypatch
):
    data = text_corpus(tmp_path / "docs.jsonl", documents=200, seed=5)
    streamed = run_pt(tiny_model_dir, data, tmp_path / "streamed", streaming="true")
    # The in-memory encoding (encode_pretraining), its chunks taken in order, not shuffled.
    monkeypatch.setattr("swiftlm.methods.pt.PT.sharded_data", lambda self, cfg, ctx, log: None)
    monkeypatch.setattr(
        run, "make_batch_plan", lambda cfg, lengths, dp, per=1: prepare.StreamPlan(lengths, 2, dp)
    )
    in_order = run_pt(tiny_model_dir, data, tmp_path / "whole")
    assert len(streamed) == 6 and streamed == in_order


@pytest.mark.numerics
@pytest.mark.parametrize("shuffle", [0, 5])  # 5: step 6 ends inside a window (chunk 24)
def test_a_resumed_stream_equals_an_uninterrupted_run_and_skips_what_it_read(
    tiny_model_dir, tmp_path, monkeypatch, shuffle
):
    data = text_corpus(tmp_path / "docs.jsonl", documents=200, seed=5)
    flags = dict(streaming="true", max_steps=10, save_steps=6, gradient_accumulation_steps=2)
    flags["shuffle_buffer_size"] = shuffle
    full = run_pt(tiny_model_dir, data, tmp_path / "full", **flags)
    saved = json.loads((tmp_path / "full/checkpoints/step-6/trainer_state.json").read_text())
    position = StreamPosition.from_json(saved["stream"])
    assert position.offset > 0  # 6 steps x 4 chunks of 48 tokens are past the first lines
    run_dir = stopped_at(tmp_path / "full", 6, tmp_path / "resumed")
    seeks = []
    real = DocumentReader._file_documents
    monkeypatch.setattr(
        DocumentReader, "_file_documents", lambda self, at: seeks.append(at) or real(self, at)
    )
    resumed = run_pt(tiny_model_dir, data, run_dir, resume_from_checkpoint="auto", **flags)
    # The same arithmetic on the same machine and shapes: bit for bit.
    assert resumed == full
    final = "final/adapter_model.safetensors"
    assert_same_weights(tmp_path / "full" / final, run_dir / final)
    # The first read is at the checkpoint's byte offset; the file's start is read again only
    # by the next pass over the corpus.
    assert (seeks[0].file, seeks[0].offset, seeks[0].line) == (0, position.offset, position.line)
    assert all(at.passes > 0 for at in seeks[1:])


@pytest.mark.bad_input(
    input="--streaming true with a hub dataset (or a .parquet/.csv/.json file)",
    outcome="A config error (exit 2) naming the dataset and the fix: local .jsonl/.txt "
    "files, or drop --streaming",
)
def test_streaming_refuses_a_hub_dataset(tiny_model_dir, tmp_path, capsys):
    argv = ["pt", "--model", str(tiny_model_dir), "--dataset", "swiftlm/self-cognition"]
    argv += ["--output_dir", str(tmp_path / "hub"), "--streaming", "true", "--max_steps", "2"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "--streaming true reads local .jsonl/.txt files" in error
    assert "swiftlm/self-cognition: not a local file" in error


@pytest.mark.bad_input(
    input="A streamed .jsonl line that is not JSON, met while training",
    outcome="The run stops with a data error (exit 1) naming file:line and --skip_bad_rows",
)
def test_a_bad_streamed_line_stops_the_run_naming_it(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "one two three"}\n\n{"text": "four"\n{"text": "five"}\n')
    argv = ["pt", "--model", str(tiny_model_dir), "--dataset", str(data), "--streaming", "true"]
    argv += ["--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--max_length", "4"]
    assert main(argv) == 1
    error = capsys.readouterr().err
    assert "bad.jsonl:3: invalid JSON" in error and "--skip_bad_rows true" in error
