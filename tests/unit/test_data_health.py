"""Data health before step 1: exact numbers on hand-made data, truncation counts that survive
the tokenized-data cache, and the summary a real `swiftlm sft` run prints and keeps."""

import json
from types import SimpleNamespace

import pytest

from conftest import CHAT_ROWS, tiny_sft, write_jsonl
from swiftlm.cli.main import main
from swiftlm.config import UNUSED_FLAGS, TrainConfig, parse_config
from swiftlm.data.cache import load_or_encode
from swiftlm.monitor.data_health import (
    LayoutFacts,
    SplitFacts,
    count_labels,
    format_data_health,
    layout_summary,
    length_histogram,
    length_stats,
    summarize_data,
)
from swiftlm.train.batching import build_batch_plan
from swiftlm.train.prepare import _layout_facts, prepare_data

LENGTHS = [3, 5, 5, 8, 10, 12, 20]
SAMPLES = [
    {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]},
    {"input_ids": [5, 6], "labels": [-100, 6]},
]
TRUNCATION = {"max_length": 2048, "strategy": "delete", "truncated": 3, "deleted": 0, "dropped": 0}


def test_length_statistics_and_histogram_are_exact():
    assert length_stats(LENGTHS) == {"min": 3, "mean": 9.0, "p50": 8, "p95": 20, "max": 20}
    # width ceil(18 / 4) = 5 from the shortest sample: [3,8) [8,13) [13,18) [18,23)
    assert length_histogram(LENGTHS, bins=4) == {
        "edges": [3, 8, 13, 18, 23],
        "counts": [3, 3, 0, 1],
    }
    # Fewer distinct lengths than bins: one bin per length.
    assert length_histogram([7, 7, 9], bins=20) == {"edges": [7, 8, 9, 10], "counts": [2, 0, 1]}


def test_label_share_counts_label_positions_in_memory_and_in_arrow(tmp_path):
    columns = ("input_ids", "labels")
    assert count_labels(SAMPLES, columns) == (3, 6, 2)
    cached = load_or_encode(
        tmp_path / "entry",
        lambda: ({"train": SAMPLES}, []),
        lambda _: None,
        columns=columns,
        length=lambda s: len(s["input_ids"]),
    )["train"]
    assert count_labels(cached, columns) == (3, 6, 2)
    # Preference pairs: both sides' labels over both sides' ids.
    pair = {"chosen_input_ids": [1, 2], "chosen_labels": [-100, 2], "rejected_input_ids": [3]}
    pair["rejected_labels"] = [3]
    assert count_labels([pair], tuple(pair)) == (2, 3, 1)
    # GRPO prompts have no labels: a reason, and the summary leaves the share out.
    reason = count_labels([{"prompt_ids": [1]}], ("prompt_ids", "row", "weight"))
    assert isinstance(reason, str) and "no label column" in reason
    train = summarize_data(SplitFacts([1], reason), None, LayoutFacts.of("fixed size", [[1]]))
    assert train["train"]["label_token_share"] is None
    assert train["train"]["label_token_share_note"] == reason


def test_large_in_memory_sets_are_sampled_for_the_label_share(monkeypatch):
    from swiftlm.monitor import data_health

    monkeypatch.setattr(data_health, "LABEL_SAMPLE_LIMIT", 2)
    samples = SAMPLES * 3  # 6 samples, every 3rd counted: the first pair, twice
    assert count_labels(samples, ("input_ids", "labels")) == (3, 6, 2)
    facts = SplitFacts([4, 2] * 3, count_labels(samples, ("input_ids", "labels")))
    summary = summarize_data(facts, None, LayoutFacts.of("fixed size", [[4, 2]]))
    assert summary["train"]["label_token_share_note"] == "estimated on 2 of 6"


@pytest.mark.parametrize(
    ("facts", "efficiency", "extra"),
    [
        # rows padded to the longest of their micro-batch: 9 real of 2*4 + 1*3 = 11 held
        (LayoutFacts.of("fixed size", [[4, 2], [3]]), 0.8182, {}),
        (LayoutFacts.of("token budget", [[4, 2], [3]]), 0.8182, {}),
        # one flat row per micro-batch: no padding
        (LayoutFacts.of("padding-free", [[4, 2], [3]], padding_free=True), 1.0, {}),
        # packed rows of 8: 18 real of 2*7 + 6 = 20 held; rows 18 / (3 * 8) full
        (LayoutFacts.of("packed", [[7, 5], [6]], row_capacity=8), 0.9, {"packed_row_fill": 0.75}),
    ],
)
def test_layout_efficiency(facts, efficiency, extra):
    summary = layout_summary(facts)
    assert summary["efficiency"] == efficiency
    assert summary["padding_share"] == round(1 - efficiency, 4)
    assert summary["micro_batches_per_epoch"] == 2
    assert {k: summary[k] for k in extra} == extra


def _held_by_hand(plan) -> int:
    """Each rank micro-batch padded to its longest row, summed from the epoch's batches."""
    batches = [b for g in plan.epoch_batches(0) for b in g if b]
    return sum(len(b) * max(plan.row_length(r) for r in b) for b in batches)


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_layout_facts_follow_the_batch_plan(dp_size):
    lengths = [4, 2, 3, 7, 1, 9, 5]
    plan = build_batch_plan(lengths, 2, dp_size, 0)
    fixed = _layout_facts(plan, 8)  # counted without building the epoch's batches
    assert fixed.kind == "fixed size" and fixed.row_capacity == 0
    assert (fixed.rows, fixed.real_tokens) == (7, sum(lengths))
    assert fixed.micro_batches == 4 and fixed.held_tokens == _held_by_hand(plan)
    packed_plan = build_batch_plan(lengths, 2, 1, 0, pack_to=10)
    packed = _layout_facts(packed_plan, 10)
    assert packed.kind == "packed" and packed.row_capacity == 10
    assert packed.real_tokens == sum(lengths) and packed.held_tokens == _held_by_hand(packed_plan)
    budget = build_batch_plan(lengths, 1, 1, 0, max_tokens=8, padding_free=True)
    facts = _layout_facts(budget, 8)
    assert facts.kind == "padding-free + token budget"
    assert facts.held_tokens == facts.real_tokens == sum(lengths)


def test_the_printed_summary_is_short_and_names_the_numbers():
    train = SplitFacts(LENGTHS, (30, 63, 7), TRUNCATION)
    summary = summarize_data(
        train, SplitFacts([5], (1, 5, 1)), LayoutFacts.of("fixed size", [[4, 2]])
    )
    text = format_data_health(summary)
    assert text.splitlines() == [
        "data: 7 samples, 63 tokens; length min/p50/p95/max 3/8/20/20; 3 truncated at 2048 "
        "tokens; labels 48% of tokens",
        "validation data: 1 sample, 5 tokens",
    ]
    assert summary["layout"]["efficiency"] == 0.75 and summary["layout"]["padding_share"] == 0.25
    assert summary["train"]["truncation"] == TRUNCATION
    json.dumps(summary)  # plain JSON values only


def _sft_config(model_dir, data, max_length: int):
    argv = ["--model", str(model_dir), "--dataset", str(data), "--max_length", str(max_length)]
    argv += ["--truncation_strategy", "left", "--split_dataset_ratio", "0.25"]
    return parse_config(TrainConfig, argv, "swiftlm sft", unused=UNUSED_FLAGS["sft"])


def test_truncation_counts_survive_a_cache_hit(tiny_model_dir, tiny_tokenizer, tmp_path):
    from swiftlm.methods.sft import SFT

    data = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    cfg = _sft_config(tiny_model_dir, data, 40)
    ctx = SimpleNamespace(is_main=True, broadcast_object=lambda value: value)
    runs = []
    for _ in range(2):
        lines: list[str] = []
        method = SFT(cfg, tiny_tokenizer)
        train, val, truncation = prepare_data(cfg, method, tiny_tokenizer, ctx, lines.append)
        runs.append((len(train), len(val), truncation, lines))
    (first, second) = runs
    assert any("cached at" in line for line in first[3])
    assert any("loaded from cache" in line for line in second[3])
    assert first[:3] == second[:3]
    assert first[2]["train"]["truncated"] > 0 and first[2]["train"]["max_length"] == 40
    assert set(first[2]) == {"train", "val"}


def test_an_sft_run_prints_and_keeps_its_data_health(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    out = tmp_path / "run"
    flags = dict(max_steps=1, max_length=40, truncation_strategy="left", padding_free="false")
    assert main(tiny_sft(tiny_model_dir, data, out, **flags)) == 0
    health = json.loads((out / "data_health.json").read_text())
    assert health["train"]["samples"] == len(CHAT_ROWS)
    assert health["train"]["truncation"]["truncated"] > 0
    assert 0 < health["train"]["label_token_share"] < 1
    assert health["layout"]["kind"] == "fixed size"
    assert sum(health["train"]["length_histogram"]["counts"]) == len(CHAT_ROWS)
    printed = capsys.readouterr().out
    assert f"data: {len(CHAT_ROWS)} samples, {health['train']['tokens']:,} tokens" in printed
    assert "batches: " in printed  # the layout's own line (describe_plan)
