"""`swiftlm pt` on token shards trains exactly as on the in-memory encoding, with the loop's
prefetch thread, and a resumed run reads none of the chunks it already trained on."""

import json
import random

import pytest

from conftest import logged, stopped_at
from swiftlm.cli.main import main
from swiftlm.data.token_shards import TokenChunks
from swiftlm.methods.pt import PT


def _corpus(path, documents=160):
    rng = random.Random(1)
    words = ["alpha", "beta", "gamma", "delta", "shard", "token", "résumé", "東京"]
    with path.open("w") as f:
        for i in range(documents):
            text = f"doc {i}: " + " ".join(rng.choices(words, k=rng.randint(2, 60)))
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return path


def _pt(model_dir, data, out, **flags):
    defaults = dict(torch_dtype="float32", report_to="none", logging_steps=1, max_length=48)
    defaults.update(per_device_train_batch_size=2, max_steps=6, learning_rate=5e-3, seed=7)
    argv = ["pt", "--model", str(model_dir), "--dataset", str(data), "--output_dir", str(out)]
    for name, value in {**defaults, **flags}.items():
        argv += [f"--{name}", str(value)]
    assert main(argv) == 0
    return logged(out)


@pytest.mark.parametrize("layout", [{}, {"packing": "true"}])
def test_token_shards_train_exactly_as_the_in_memory_encoding(
    tiny_model_dir, tmp_path, monkeypatch, layout
):
    data = _corpus(tmp_path / "docs.jsonl")
    sharded = _pt(tiny_model_dir, data, tmp_path / "sharded", dataset_num_proc=2, **layout)
    monkeypatch.setattr(PT, "sharded_data", lambda self, cfg, ctx, log: None)
    whole = _pt(tiny_model_dir, data, tmp_path / "whole", **layout)
    assert len(sharded) == 6 and sharded == whole  # same chunks, same order, same losses


def test_a_resume_reads_no_chunk_it_already_trained_on(tiny_model_dir, tmp_path, monkeypatch):
    data = _corpus(tmp_path / "docs.jsonl", documents=200)
    full = _pt(tiny_model_dir, data, tmp_path / "full", max_steps=10, save_steps=6)
    run = stopped_at(tmp_path / "full", 6, tmp_path / "resumed")
    read = []
    real = TokenChunks.__getitem__
    monkeypatch.setattr(TokenChunks, "__getitem__", lambda self, i: read.append(i) or real(self, i))
    resumed = _pt(
        tiny_model_dir, data, run, max_steps=10, save_steps=6, resume_from_checkpoint="auto"
    )
    assert resumed == full  # logged losses of steps 1-10: steps 7-10 retrained identically
    # Steps 7-10 of batch size 2 read 8 chunks (the prefetch thread reads ahead at most the
    # steps that exist); none of steps 1-6's 12 chunks is read again.
    assert len(read) == 8 and len(set(read)) == 8
