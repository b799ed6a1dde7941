"""Sequence parallel for the preference methods: 2 gloo ranks with `--sequence_parallel_size 2`
each hold half of every answer's tokens, sum their shards' log-probs over the group, and give
the losses, margins and weights of one process on the same pairs (DPO padded and packed, full
fine-tuning's frozen reference, KTO with its mismatched KL rows)."""

import pytest
from test_dpo import ROWS as PAIRS
from test_dpo import rlhf
from test_kto import ROWS as ANSWERS

from conftest import logged, write_jsonl
from swiftlm.cli.main import main
from tolerance import assert_close, assert_trained_weights_close, forward_terms

STEPS = dict(max_steps=3, learning_rate="5e-3", lora_dropout=0, per_device_train_batch_size=4)
ADAPTER = "final/adapter_model.safetensors"
# Rows of at most 64 tokens; + 2 for the all-reduce of the two shards' sums and the
# all-to-all's reordering of attention over the whole sequence.
TERMS = forward_terms(tokens=64) + 2


def _pair(model, data, tmp_path, port, **flags):
    single, shards = tmp_path / "single", tmp_path / "sp"
    assert main(rlhf(model, data, single, **STEPS, **flags)) == 0
    sp = dict(nproc_per_node=2, sequence_parallel_size=2, master_port=port)
    assert main(rlhf(model, data, shards, **STEPS, **flags, **sp)) == 0
    return single, shards


def _assert_same_run(single, shards, figures):
    size = max(map(abs, logged(single, figures[0])))  # what the loss is made of
    assert_close(logged(shards), logged(single), terms=TERMS, magnitude=size, what="loss")
    for name in figures:
        got, expected = logged(shards, name), logged(single, name)
        assert_close(got, expected, terms=TERMS, magnitude=size, what=name)


@pytest.mark.numerics
@pytest.mark.parametrize("layout", [dict(), dict(padding_free="true")], ids=["padded", "packed"])
def test_dpo_over_two_sequence_shards_matches_one_process(layout, tiny_model_dir, tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    port = 29591 + bool(layout)
    single, shards = _pair(tiny_model_dir, pairs, tmp_path, port, rlhf_type="dpo", **layout)
    _assert_same_run(single, shards, ["logps/chosen", "logps/rejected", "rewards/margins"])
    assert_trained_weights_close(single / ADAPTER, shards / ADAPTER, learning_rate=5e-3, steps=3)


@pytest.mark.numerics
def test_full_fine_tuning_reference_reads_the_same_shards(tiny_model_dir, tmp_path):
    """The frozen copy of the initial model is not the wrapped policy: it is given the
    policy's sequence-parallel attention, or it would attend within its shard alone."""
    pairs = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    single, shards = _pair(
        tiny_model_dir, pairs, tmp_path, 29593, rlhf_type="dpo", train_type="full"
    )
    _assert_same_run(single, shards, ["logps/chosen", "rewards/margins"])


@pytest.mark.numerics
def test_kto_with_its_kl_rows_matches_one_process(tiny_model_dir, tmp_path):
    answers = write_jsonl(tmp_path / "answers.jsonl", ANSWERS)
    single, shards = _pair(tiny_model_dir, answers, tmp_path, 29594, rlhf_type="kto")
    _assert_same_run(single, shards, ["logps/chosen", "kl", "count/chosen"])
    assert_trained_weights_close(single / ADAPTER, shards / ADAPTER, learning_rate=5e-3, steps=3)
