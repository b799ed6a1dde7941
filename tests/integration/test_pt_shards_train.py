"""`swiftlm pt` on token shards trains exactly as on the in-memory encoding, with the loop's
prefetch thread, and a resumed run reads none of the chunks it already trained on."""

import pytest

from conftest import run_pt, stopped_at, text_corpus
from swiftlm.data.token_shards import TokenChunks
from swiftlm.methods.pt import PT


@pytest.mark.parametrize("layout", [{}, {"packing": "true"}])
def test_token_shards_train_exactly_as_the_in_memory_encoding(
    tiny_model_dir, tmp_path, monkeypatch, layout
):
    data = text_corpus(tmp_path / "docs.jsonl", documents=160, seed=1)
    sharded = run_pt(tiny_model_dir, data, tmp_path / "sharded", dataset_num_proc=2, **layout)
    monkeypatch.setattr(PT, "sharded_data", lambda self, cfg, ctx, log: None)
    whole = run_pt(tiny_model_dir, data, tmp_path / "whole", **layout)
    assert len(sharded) == 6 and sharded == whole  # same chunks, same order, same losses


def test_a_resume_reads_no_chunk_it_already_trained_on(tiny_model_dir, tmp_path, monkeypatch):
    data = text_corpus(tmp_path / "docs.jsonl", documents=200, seed=1)
    full = run_pt(tiny_model_dir, data, tmp_path / "full", max_steps=10, save_steps=6)
    run = stopped_at(tmp_path / "full", 6, tmp_path / "resumed")
    read = []
    real = TokenChunks.__getitem__
    monkeypatch.setattr(TokenChunks, "__getitem__", lambda self, i: read.append(i) or real(self, i))
    resumed = run_pt(
        tiny_model_dir, data, run, max_steps=10, save_steps=6, resume_from_checkpoint="auto"
    )
    assert resumed == full  # logged losses of steps 1-10: steps 7-10 retrained identically
    # Steps 7-10 of batch size 2 read 8 chunks (the prefetch thread reads ahead at most the
    # steps that exist); none of steps 1-6's 12 chunks is read again.
    assert len(read) == 8 and len(set(read)) == 8
