"""Sequence parallel (`--sequence_parallel_size 2`, Ulysses and ring) over 2 gloo ranks equals
one process on the same micro-batches, in every layout, and resumes exactly."""

import pytest

from conftest import logged, stopped_at, text_corpus, tiny_sft
from swiftlm.cli.main import main
from tolerance import assert_close, assert_same_weights, assert_trained_weights_close, forward_terms

ADAPTER = "adapter_model.safetensors"
RUN = dict(lora_dropout=0, learning_rate="1e-2", max_steps=4, per_device_train_batch_size=4)
# Rows of at most 64 tokens; + 2 for the two ranks' sums of each figure and the all-to-all's
# reordering of attention over the whole sequence.
TERMS = forward_terms(tokens=64) + 2


def _pair(model, data, tmp_path, port, **flags):
    single, shards = tmp_path / "single", tmp_path / "sp"
    assert main(tiny_sft(model, data, single, **RUN, **flags)) == 0
    argv = tiny_sft(
        model, data, shards, **RUN, **flags, nproc_per_node=2, sequence_parallel_size=2,
        master_port=port,
    )  # fmt: skip
    assert main(argv) == 0
    return single, shards


@pytest.mark.numerics
def test_two_sequence_shards_match_one_process_and_resume_exactly(
    tiny_model_dir, chat_jsonl, tmp_path, capfd
):
    single, shards = _pair(tiny_model_dir, chat_jsonl, tmp_path, 29551, save_steps=2)
    assert "x 2 (sequence parallel 2" in capfd.readouterr().out  # rank 0's log line
    assert_close(logged(shards), logged(single), terms=TERMS, what="loss")
    # Each label is a target on exactly one shard: the counts are the whole rows'.
    assert logged(shards, "label_tokens") == logged(single, "label_tokens")
    assert_trained_weights_close(
        single / "final" / ADAPTER, shards / "final" / ADAPTER, learning_rate=1e-2, steps=4
    )
    resumed = stopped_at(shards, 2, tmp_path / "resumed")
    again = dict(
        RUN, save_steps=2, nproc_per_node=2, sequence_parallel_size=2, master_port=29552,
        resume_from_checkpoint="auto",
    )  # fmt: skip
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, resumed, **again)) == 0
    assert logged(resumed) == logged(shards)
    assert_same_weights(shards / "final" / ADAPTER, resumed / "final" / ADAPTER)


@pytest.mark.numerics
@pytest.mark.parametrize("impl", ["ulysses", "ring"])
@pytest.mark.parametrize(
    "layout",
    [dict(padding_free="false"), dict(packing="true", max_length=128)],
    ids=["padded", "packed"],
)
def test_padded_and_packed_rows_are_sharded_as_whole_sequences(
    layout, impl, tiny_model_dir, chat_jsonl, tmp_path, capfd
):
    """Padded rows: causal attention over the gathered row keeps pads out of real tokens.
    Packed rows: samples' boundaries come from the gathered position ids, so no token attends
    across a sample even where a sample spans both shards."""
    port = 29553 + 2 * ("packing" in layout) + (impl == "ring")
    single, shards = _pair(
        tiny_model_dir, chat_jsonl, tmp_path, port, **layout, sequence_parallel_impl=impl
    )
    assert f"sequence parallel 2: {impl} attention" in capfd.readouterr().out
    terms = forward_terms(tokens=128 if "packing" in layout else 64) + 2
    assert_close(logged(shards), logged(single), terms=terms, what="loss")
    assert logged(shards, "label_tokens") == logged(single, "label_tokens")


@pytest.mark.numerics
def test_sequence_shards_inside_tensor_parallel_groups_match_one_process(
    tiny_model_dir, chat_jsonl, tmp_path, capfd
):
    """4 ranks: tensor parallel 2 splits the heads (2 and 1 key/value head per rank), sequence
    parallel 2 splits the tokens; 1 key/value head does not divide by 2, so auto takes the
    ring. The two sequence shards reduce gradients with FSDP2 (DDP cannot replicate the
    tensor-parallel DTensor weights)."""
    single, shards = tmp_path / "single", tmp_path / "tp-sp"
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, single, **RUN)) == 0
    mesh = dict(nproc_per_node=4, tensor_parallel_size=2, sequence_parallel_size=2)
    argv = tiny_sft(tiny_model_dir, chat_jsonl, shards, **RUN, **mesh, master_port=29557)
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert "sequence parallel 2: ring attention" in out
    assert "tensor parallel 2 x sequence parallel 2" in out
    assert_close(logged(shards), logged(single), terms=TERMS + 2, what="loss")
    assert logged(shards, "label_tokens") == logged(single, "label_tokens")
    assert_trained_weights_close(
        single / "final" / ADAPTER, shards / "final" / ADAPTER, learning_rate=1e-2, steps=4
    )


@pytest.mark.numerics
def test_pretraining_on_the_ring_matches_one_process(tiny_model_dir, tmp_path):
    """`swiftlm pt` cuts the joined documents into rows of --max_length chunks; the ring
    attends each row causally across the two shards."""
    docs = text_corpus(tmp_path / "docs.jsonl", documents=40, seed=3)
    single, shards = tmp_path / "single", tmp_path / "sp"
    flags = dict(RUN, max_length=96)
    assert main(["pt", *tiny_sft(tiny_model_dir, docs, single, **flags)[1:]]) == 0
    sp = dict(nproc_per_node=2, sequence_parallel_size=2, sequence_parallel_impl="ring")
    argv = tiny_sft(tiny_model_dir, docs, shards, **flags, **sp, master_port=29558)
    assert main(["pt", *argv[1:]]) == 0
    assert_close(logged(shards), logged(single), terms=forward_terms(tokens=96) + 2, what="loss")
    assert logged(shards, "label_tokens") == logged(single, "label_tokens")
    assert_trained_weights_close(
        single / "final" / ADAPTER, shards / "final" / ADAPTER, learning_rate=1e-2, steps=4
    )
