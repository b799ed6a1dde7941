"""Padding-free, packed and token-budget runs through the CLI."""

import json

import pytest
from tests.conftest import logged, tiny_sft

from swiftlm.cli.main import main
from tolerance import assert_close, assert_trained_weights_close, forward_terms

STEPS = dict(max_steps=4, learning_rate=1e-3, lora_dropout=0, save_steps=100)
# CHAT_ROWS' conversations are shorter than 64 tokens; a flat row holds a micro-batch's 4.
TERMS = forward_terms(tokens=4 * 64)


@pytest.mark.numerics
def test_padding_free_trains_exactly_like_padded_batches(
    tiny_model_dir, chat_jsonl, tmp_path, capsys
):
    """Same samples per step, one flat row instead of a padded batch: same losses, same
    adapter (fp32, up to rounding: tests/tolerance.py)."""
    padded, flat = tmp_path / "padded", tmp_path / "flat"
    batch = dict(STEPS, per_device_train_batch_size=4)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, padded, **batch, padding_free="false")) == 0
    # The two runs really differ in layout: the padded one computes padding tokens.
    assert "padding 0.0%" not in capsys.readouterr().out
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, flat, **batch, padding_free="true")) == 0
    assert "padding 0.0%" in capsys.readouterr().out
    assert_close(logged(flat), logged(padded), terms=TERMS, what="losses")
    assert logged(flat, "label_tokens") == logged(padded, "label_tokens")
    adapter = "final/adapter_model.safetensors"
    assert_trained_weights_close(padded / adapter, flat / adapter, learning_rate=1e-3, steps=4)
    # The saved config is the model's usual one: the training-only attention is not kept.
    config = json.loads((flat / "final" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"]


def test_packing_fills_rows_and_trains(tiny_model_dir, chat_jsonl, tmp_path, capsys):
    out = tmp_path / "packed"
    flags = dict(STEPS, max_steps=6, packing="true", max_length=128)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, out, **flags)) == 0
    printed = capsys.readouterr().out
    # 24 samples of ~41 tokens fit 3 to a 128-token row.
    assert "24 samples packed into 8 rows" in printed
    losses = logged(out)
    assert losses[-1] < losses[0]


def test_token_budget_batches(tiny_model_dir, chat_jsonl, tmp_path, capsys):
    out = tmp_path / "budget"
    flags = dict(STEPS, max_tokens_per_batch=264, max_length=128, num_train_epochs=1)
    flags["padding_free"] = "false"
    flags["max_steps"] = -1
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, out, **flags)) == 0
    printed = capsys.readouterr().out
    # 39-43-token samples, 264-token budget: 6 padded rows per micro-batch, 4 micro-batches.
    assert "4 micro-batches per epoch" in printed
    assert logged(out, "step")[-1] == 4
    # Padding-free, the budget counts real tokens only: 6 samples of 39-43 still fit.
    flags["padding_free"] = "true"
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, tmp_path / "flat", **flags)) == 0
    assert "4 micro-batches per epoch, padding 0.0%" in capsys.readouterr().out


def test_second_run_reuses_the_tokenized_cache(tiny_model_dir, chat_jsonl, tmp_path, capsys):
    flags = dict(STEPS, max_steps=1, max_length=100)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, tmp_path / "a", **flags)) == 0
    first = capsys.readouterr().out
    assert "tokenized data in" in first and "cached at" in first
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, tmp_path / "b", **flags)) == 0
    second = capsys.readouterr().out
    assert "tokenized data loaded from cache" in second
    assert logged(tmp_path / "b") == logged(tmp_path / "a")
    # Other content, other entry: one changed row re-tokenizes.
    rows = chat_jsonl.read_text().splitlines()
    rows[0] = rows[0].replace("Answer number 0", "Answer zero")
    chat_jsonl.write_text("\n".join(rows) + "\n")
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, tmp_path / "c", **flags)) == 0
    assert "tokenized data in" in capsys.readouterr().out
    # An option the encoding depends on does too, and the cache can be bypassed.
    assert (
        main(tiny_sft(tiny_model_dir, chat_jsonl, tmp_path / "d", **dict(flags, max_length=90)))
        == 0
    )
    assert "tokenized data in" in capsys.readouterr().out
    no_cache = dict(flags, load_from_cache_file="false")
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, tmp_path / "e", **no_cache)) == 0
    assert "cache" not in capsys.readouterr().out


def test_auto_batch_size_is_chosen_printed_and_saved(tiny_model_dir, chat_jsonl, tmp_path, capsys):
    out = tmp_path / "auto"
    flags = dict(STEPS, max_steps=1, per_device_train_batch_size="auto")
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, out, **flags)) == 0
    printed = capsys.readouterr().out
    # A tiny model has room for the largest batch the planner allows.
    assert "--per_device_train_batch_size auto: 64 (planned from" in printed
    assert "per_device_train_batch_size: 64" in (out / "config.yaml").read_text()
    assert logged(out, "label_tokens")[0] > 20 * 10  # all 24 samples in the one micro-batch


@pytest.mark.slow
@pytest.mark.numerics
def test_torch_compile_trains_like_eager(tiny_model_dir, chat_jsonl, tmp_path):
    """Compiled decoder layers give the eager losses (fp32; inductor may fuse differently)."""
    flags = dict(STEPS, per_device_train_batch_size=4)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, tmp_path / "eager", **flags)) == 0
    compiled = dict(flags, torch_compile="true")
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, tmp_path / "compiled", **compiled)) == 0
    eager = logged(tmp_path / "eager")
    assert_close(logged(tmp_path / "compiled"), eager, terms=TERMS, what="compiled losses")


def test_an_unreadable_cache_entry_is_rebuilt(tiny_model_dir, chat_jsonl, tmp_path, capsys):
    import os
    from pathlib import Path

    flags = dict(STEPS, max_steps=1, max_length=80)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, tmp_path / "a", **flags)) == 0
    capsys.readouterr()
    root = Path(os.environ["SWIFTLM_DATA_CACHE"])
    for arrow in root.rglob("*.arrow"):
        arrow.write_bytes(b"not arrow")
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, tmp_path / "b", **flags)) == 0
    assert "is unreadable" in capsys.readouterr().out
    assert logged(tmp_path / "b") == logged(tmp_path / "a")
