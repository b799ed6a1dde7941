"""Bootstrap intervals, paired tests (McNemar, paired bootstrap) and `swiftlm eval` comparisons.

scipy is the independent reference for the exact binomial test; swiftlm itself uses numpy only.
"""

import json
import os

import numpy as np
import pytest
from scipy import stats as scipy_stats

from swiftlm.errors import ConfigError, DataError
from swiftlm.evaluation.compare import (
    compare_results,
    comparison_to_json,
    format_comparison,
    load_results,
    lower_is_better,
    verdict,
)
from swiftlm.evaluation.stats import (
    MCNEMAR,
    PAIRED_BOOTSTRAP,
    bootstrap_interval,
    is_binary,
    mcnemar_exact_p,
    paired_difference,
)

# ---------------------------------------------------------------- bootstrap_interval


def test_interval_mean_is_exact_and_inside_the_interval():
    scores = [0.2, 0.9, 0.4, 0.7, 0.1, 0.55, 0.8, 0.3]
    interval = bootstrap_interval(scores)
    assert interval.mean == pytest.approx(sum(scores) / len(scores), abs=1e-15)
    assert interval.low < interval.mean < interval.high
    assert interval.confidence == 0.95


def test_interval_shrinks_like_one_over_sqrt_n():
    rng = np.random.default_rng(3)
    widths = {}
    for n in (200, 3200):
        interval = bootstrap_interval(rng.normal(size=n), resamples=4000)
        widths[n] = interval.high - interval.low
    # 16x the samples: a quarter of the width (sqrt(16) = 4), up to bootstrap noise.
    assert widths[200] / widths[3200] == pytest.approx(4.0, rel=0.1)


def test_binary_interval_matches_wald_for_large_n():
    rng = np.random.default_rng(7)
    scores = (rng.random(2000) < 0.3).astype(float)
    p = scores.mean()
    half = 1.959964 * np.sqrt(p * (1 - p) / scores.size)
    interval = bootstrap_interval(scores)
    assert interval.low == pytest.approx(p - half, abs=0.005)
    assert interval.high == pytest.approx(p + half, abs=0.005)


def test_continuous_interval_matches_the_normal_interval():
    # Pins the percentiles: a 90% interval instead of 95% would be 16% narrower.
    scores = np.random.default_rng(9).normal(size=2000)
    half = 1.959964 * scores.std(ddof=1) / np.sqrt(scores.size)
    interval = bootstrap_interval(scores)
    assert (interval.high - interval.low) / 2 == pytest.approx(half, rel=0.04)
    assert (interval.low + interval.high) / 2 == pytest.approx(scores.mean(), abs=0.1 * half)


def test_count_resampling_matches_index_resampling(monkeypatch):
    # Binary scores take the multinomial shortcut; forcing index draws must agree with it.
    import swiftlm.evaluation.stats as stats

    scores = (np.random.default_rng(10).random(1000) < 0.4).astype(float)
    counts = bootstrap_interval(scores, resamples=20_000)
    monkeypatch.setattr(stats, "_MAX_DISTINCT_FOR_COUNTS", 0)
    indices = bootstrap_interval(scores, resamples=20_000)
    assert counts.low == pytest.approx(indices.low, abs=0.002)
    assert counts.high == pytest.approx(indices.high, abs=0.002)


def test_same_seed_same_interval_other_seed_differs():
    scores = np.random.default_rng(0).random(300)
    assert bootstrap_interval(scores, seed=5) == bootstrap_interval(scores, seed=5)
    assert bootstrap_interval(scores, seed=5) != bootstrap_interval(scores, seed=6)


def test_chunked_index_resampling_is_deterministic_across_chunks(monkeypatch):
    # Many distinct values take the index path; a tiny chunk forces many chunks.
    import swiftlm.evaluation.stats as stats

    scores = np.random.default_rng(1).random(500)
    whole = bootstrap_interval(scores, resamples=2000)
    monkeypatch.setattr(stats, "_CHUNK_ELEMENTS", 700)
    assert bootstrap_interval(scores, resamples=2000) == bootstrap_interval(scores, resamples=2000)
    chunked = bootstrap_interval(scores, resamples=2000)
    assert chunked.low == pytest.approx(whole.low, abs=0.01)


def test_one_score_and_constant_scores_have_a_zero_width_interval():
    one = bootstrap_interval([0.7])
    assert (one.mean, one.low, one.high) == (0.7, 0.7, 0.7)
    same = bootstrap_interval([1.0] * 50)
    assert (same.low, same.high) == (1.0, 1.0)


def test_no_scores_or_nan_scores_are_refused():
    with pytest.raises(ValueError, match="no scores"):
        bootstrap_interval([])
    with pytest.raises(ValueError, match="NaN"):
        bootstrap_interval([0.1, float("nan")])


@pytest.mark.parametrize("settings", [{"confidence": 1.0}, {"confidence": 0}, {"resamples": 0}])
def test_bad_confidence_or_resamples_is_a_config_error(settings):
    with pytest.raises(ConfigError, match="use e.g."):
        bootstrap_interval([0.1, 0.2], **settings)


def test_is_binary():
    assert is_binary([0, 1, 1.0, 0.0])
    assert not is_binary([0, 1, 0.5])
    assert not is_binary([])


# ---------------------------------------------------------------- McNemar


@pytest.mark.parametrize(
    "b_wins, a_wins", [(0, 1), (1, 0), (3, 9), (9, 3), (10, 10), (7, 8), (25, 40), (0, 30)]
)
def test_mcnemar_matches_scipy_binomtest(b_wins, a_wins):
    expected = scipy_stats.binomtest(b_wins, b_wins + a_wins, 0.5).pvalue
    assert mcnemar_exact_p(b_wins, a_wins) == pytest.approx(expected, rel=1e-9)


def test_mcnemar_large_counts_stay_accurate():
    expected = scipy_stats.binomtest(4800, 10000, 0.5).pvalue
    assert mcnemar_exact_p(4800, 5200) == pytest.approx(expected, rel=1e-7)


def test_paired_binary_uses_mcnemar_on_discordant_pairs():
    a = [1, 1, 0, 0, 1, 0, 1, 0, 0, 0, 1, 1]
    b = [1, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1]  # B wins 5, A wins 1, 6 concordant
    result = paired_difference(a, b)
    assert result.test == MCNEMAR
    assert (result.b_wins, result.a_wins, result.n) == (5, 1, 12)
    assert result.p_value == pytest.approx(scipy_stats.binomtest(5, 6, 0.5).pvalue)
    assert result.diff == pytest.approx(4 / 12)
    assert result.low <= result.diff <= result.high


def test_no_discordant_pairs_gives_p_one():
    a = [1, 0, 1, 1, 0]
    result = paired_difference(a, list(a))
    assert (result.p_value, result.diff, result.low, result.high) == (1.0, 0.0, 0.0, 0.0)
    assert result.test == MCNEMAR


# ---------------------------------------------------------------- paired bootstrap


def test_identical_continuous_inputs():
    a = np.random.default_rng(2).random(200)
    result = paired_difference(a, a.copy())
    assert result.test == PAIRED_BOOTSTRAP
    assert (result.diff, result.low, result.high, result.p_value) == (0.0, 0.0, 0.0, 1.0)


def test_clear_shift_is_significant():
    rng = np.random.default_rng(4)
    a = rng.random(100)
    b = a + 0.5 + rng.normal(scale=0.2, size=100)
    result = paired_difference(a, b)
    assert result.test == PAIRED_BOOTSTRAP
    assert result.p_value < 0.01
    assert result.low > 0
    assert result.diff == pytest.approx(b.mean() - a.mean())


def test_bootstrap_p_value_is_never_zero():
    # A constant shift: no resampled null mean reaches it, yet p is 2/(resamples + 1), not 0.
    a = np.arange(50) * 0.25
    result = paired_difference(a, a + 0.5, resamples=999)
    assert (result.diff, result.low, result.high) == (0.5, 0.5, 0.5)
    assert result.p_value == pytest.approx(2 / 1000)


def test_no_shift_is_not_significant():
    rng = np.random.default_rng(5)
    a = rng.random(300)
    b = a + rng.normal(scale=0.1, size=300) - 0.0
    result = paired_difference(a, b)
    assert result.p_value > 0.05
    assert result.low < 0 < result.high


def test_pairing_detects_a_small_shift_that_separate_intervals_miss():
    # Per-sample difficulty dominates the spread; B is a little better on every sample.
    rng = np.random.default_rng(6)
    difficulty = rng.normal(scale=1.0, size=200)
    a = difficulty
    b = difficulty + 0.05 + rng.normal(scale=0.02, size=200)
    paired = paired_difference(a, b, resamples=4000)
    assert paired.p_value < 0.01 and paired.low > 0
    # Unpaired: the two means' intervals overlap heavily, and so would a two-sample test.
    ia, ib = bootstrap_interval(a, resamples=4000), bootstrap_interval(b, resamples=4000)
    assert ia.high > ib.low
    assert scipy_stats.ttest_ind(a, b).pvalue > 0.5


@pytest.mark.parametrize("shift", [0.005, 0.01, 0.02])
def test_shift_to_null_p_value_tracks_a_t_test(shift):
    # For a moderate n, the two-sided bootstrap p-value is close to the paired t-test's.
    rng = np.random.default_rng(8)
    a = rng.random(400)
    b = a + shift + rng.normal(scale=0.2, size=400)
    result = paired_difference(a, b, resamples=20_000)
    expected = scipy_stats.ttest_rel(b, a).pvalue
    assert 0.001 < expected < 0.9  # a case where doubling the tail matters
    assert result.p_value == pytest.approx(expected, abs=0.02)


def test_mixed_binary_and_continuous_use_the_bootstrap():
    result = paired_difference([0, 1, 1, 0], [0.2, 0.9, 0.5, 0.4])
    assert result.test == PAIRED_BOOTSTRAP


def test_unequal_lengths_are_refused():
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([1, 0], [1])


# ---------------------------------------------------------------- compare


def write_results(folder, rows, model=None):
    folder.mkdir()
    lines = [
        json.dumps({"task": t, "id": i, "prompt": "q", "prediction": "p", "scores": s})
        for t, i, s in rows
    ]
    (folder / "predictions.jsonl").write_text("\n".join(lines) + "\n")
    if model:
        (folder / "manifest.json").write_text(json.dumps({"model": {"description": model}}))
    return folder


def synthetic(tmp_path):
    # qa: ids 0..59 in A, 10..69 in B (50 shared); B is right where A is right, and more.
    rows_a, rows_b = [], []
    for i in range(60):
        rows_a.append(("qa", f"qa:{i}", {"exact_match": float(i % 3 == 0), "rouge_l": 0.5}))
    for i in range(10, 70):
        scores = {"exact_match": float(i % 3 == 0 or i % 3 == 1), "rouge_l": 0.5 + i / 1000}
        rows_b.append(("qa", f"qa:{i}", scores))
    rows_a.append(("code", "c:0", {"pass@1": 1.0, "chrf": 0.3}))
    rows_b.append(("code", "c:0", {"pass@1": 1.0}))
    a = write_results(tmp_path / "a", rows_a, model="base")
    b = write_results(tmp_path / "b", rows_b, model="tuned")
    return load_results(a), load_results(b)


def test_compare_matches_by_task_and_id_and_reports_the_rest(tmp_path):
    a, b = synthetic(tmp_path)
    c = compare_results(a, b, resamples=2000)
    tasks = {t.task: t for t in c.tasks}
    assert (tasks["qa"].matched, tasks["qa"].only_a, tasks["qa"].only_b) == (50, 10, 10)
    rows = {(r.task, r.metric): r for r in c.rows}
    em = rows["qa", "exact_match"].result
    shared = range(10, 60)
    expected_a = np.mean([i % 3 == 0 for i in shared])
    expected_b = np.mean([i % 3 != 2 for i in shared])
    assert (em.n, em.mean_a, em.mean_b) == (
        50,
        pytest.approx(expected_a),
        pytest.approx(expected_b),
    )
    assert em.test == MCNEMAR and em.a_wins == 0 and em.b_wins == sum(i % 3 == 1 for i in shared)
    assert rows["qa", "exact_match"].verdict.startswith("B better (p=")
    rouge = rows["qa", "rouge_l"].result
    assert rouge.diff == pytest.approx(np.mean([i / 1000 for i in shared]))
    assert rouge.test == PAIRED_BOOTSTRAP
    assert [(s.task, s.metric) for s in c.skipped] == [("code", "chrf")]
    assert "only A" in c.skipped[0].reason


def test_compare_table_and_json(tmp_path):
    a, b = synthetic(tmp_path)
    c = compare_results(a, b, resamples=500)
    text = format_comparison(c)
    assert "(base)" in text and "(tuned)" in text
    assert "qa: 50 in both, 10 only in A, 10 only in B" in text
    assert "code / chrf: only A has this metric" in text
    assert "B better" in text and "mcnemar-exact" in text
    data = json.loads(json.dumps(comparison_to_json(c)))
    assert data["a"]["model"] == "base"
    assert {row["metric"] for row in data["comparisons"]} == {"exact_match", "rouge_l", "pass@1"}


def test_lower_is_better_metrics_flip_the_verdict(tmp_path):
    rows_a = [("lm", str(i), {"nll_per_token": 2.0 + i / 100}) for i in range(40)]
    rows_b = [("lm", str(i), {"nll_per_token": 1.5 + i / 100}) for i in range(40)]
    a = load_results(write_results(tmp_path / "a", rows_a))
    b = load_results(write_results(tmp_path / "b", rows_b))
    row = compare_results(a, b, resamples=500).rows[0]
    assert row.lower_is_better and row.result.diff == pytest.approx(-0.5)
    assert row.verdict.startswith("B better")


@pytest.mark.parametrize(
    "metric, lower",
    [
        ("nll_per_token", True),
        ("perplexity", True),
        ("eval_loss", True),
        ("wer", True),
        ("answer_match", False),  # "wer" inside a word is not the word error rate
        ("rouge_l", False),
        ("pass@1", False),
    ],
)
def test_lower_is_better_reads_whole_words(metric, lower):
    assert lower_is_better(metric) is lower


def test_verdict_without_significance(tmp_path):
    result = paired_difference([1, 0, 1, 0], [0, 1, 1, 0])
    assert verdict(result, confidence=0.95, lower_better=False).startswith("no significant")


def test_no_shared_samples_is_a_clear_error(tmp_path):
    a = load_results(write_results(tmp_path / "a", [("qa", "1", {"exact_match": 1.0})]))
    b = load_results(write_results(tmp_path / "b", [("math", "1", {"exact_match": 1.0})]))
    with pytest.raises(ConfigError, match="share no samples.*qa vs math.*--eval_limit"):
        compare_results(a, b)


def test_damaged_line_is_named_by_file_and_line(tmp_path):
    folder = write_results(tmp_path / "a", [("qa", str(i), {"exact_match": 1.0}) for i in range(4)])
    lines = (folder / "predictions.jsonl").read_text().splitlines()
    lines[2] = lines[2][:-5]
    (folder / "predictions.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"predictions\.jsonl:3: not valid JSON"):
        load_results(folder)


def test_bad_scores_and_duplicate_ids_are_refused(tmp_path):
    bad = write_results(tmp_path / "bad", [("qa", "1", {"exact_match": "yes"})])
    with pytest.raises(DataError, match=r"predictions\.jsonl:1: score 'exact_match'"):
        load_results(bad)
    dup = write_results(tmp_path / "dup", [("qa", "1", {"em": 1.0}), ("qa", "1", {"em": 0.0})])
    with pytest.raises(DataError, match=r":2: sample '1' of task 'qa' is already on line 1"):
        load_results(dup)


def test_missing_folder_or_predictions(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_results(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no predictions.jsonl.*--eval_output_dir of a `swiftlm"):
        load_results(tmp_path / "empty")


def test_predictions_file_path_is_accepted(tmp_path):
    folder = write_results(tmp_path / "a", [("qa", "1", {"exact_match": 1.0})])
    assert load_results(folder / "predictions.jsonl").folder == folder


def test_run_directory_reads_its_newest_evaluation(tmp_path):
    (tmp_path / "run" / "eval").mkdir(parents=True)
    old = write_results(tmp_path / "run" / "eval" / "20260101-000000", [("qa", "1", {"em": 0.0})])
    new = write_results(tmp_path / "run" / "eval" / "20260102-000000", [("qa", "1", {"em": 1.0})])
    os.utime(old / "predictions.jsonl", (1_000_000, 1_000_000))
    results = load_results(tmp_path / "run")
    assert results.folder == new and results.scores == {("qa", "1"): {"em": 1.0}}
