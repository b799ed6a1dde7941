"""Confidence intervals and paired significance tests for per-sample evaluation scores.

An evaluation score is the mean of per-sample scores over a finite test set, so it carries
sampling noise: two checkpoints a point apart on 200 questions may not differ at all. This
module puts an interval on every mean and a p-value on every difference, with numpy only.

- `bootstrap_interval`: the percentile bootstrap of the mean. It is used for binary (0/1)
  scores too rather than a Wald or Wilson formula, so that every metric's interval means the
  same thing; for large n it agrees with the normal approximation (the tests check this).
- `paired_difference`: the difference of two evaluations *on the same samples*. Pairing
  removes the per-sample difficulty that both models share, which is why it detects shifts
  that comparing two independent intervals would miss. Binary scores get the exact McNemar
  test; other scores the paired bootstrap with the "shift to the null" p-value.

Resampling draws the same number of values as the sample has, with replacement. Only the
*counts* of each distinct value matter for a resampled mean, so a sample with few distinct
values (binary scores, or per-sample differences of binary scores: -1, 0, 1) is resampled
by drawing those counts from a multinomial: the same distribution as drawing indices, at a
cost independent of n. Other samples draw indices in chunks, to bound memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from swiftlm.errors import ConfigError

MCNEMAR = "mcnemar-exact"
PAIRED_BOOTSTRAP = "paired-bootstrap"

# At most this many resampled indices live in memory at once (8 bytes each: 32 MiB).
_CHUNK_ELEMENTS = 1 << 22
# Up to this many distinct values, resample counts (multinomial) instead of indices.
_MAX_DISTINCT_FOR_COUNTS = 32


@dataclass(frozen=True)
class Interval:
    """The mean of a sample and a `confidence` bootstrap interval [low, high] around it."""

    mean: float
    low: float
    high: float
    confidence: float


@dataclass(frozen=True)
class PairedDifference:
    """Evaluation B against evaluation A on the same n samples.

    `diff` is mean_b - mean_a, and [low, high] its paired bootstrap interval. `b_wins` counts
    samples where B scored higher than A, `a_wins` the reverse: for binary scores these are
    McNemar's discordant pairs. `test` names how `p_value` was computed.
    """

    mean_a: float
    mean_b: float
    diff: float
    low: float
    high: float
    p_value: float
    test: str
    n: int
    b_wins: int
    a_wins: int


def is_binary(scores) -> bool:
    """True when every score is 0 or 1 (an empty sample is not binary)."""
    values = np.asarray(scores, dtype=float)
    return values.size > 0 and bool(np.all((values == 0.0) | (values == 1.0)))


def bootstrap_interval(
    scores, *, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> Interval:
    """The mean of `scores` and its percentile bootstrap interval.

    Deterministic for a given seed. One score gives low = high = mean (a single sample
    cannot show any spread). No scores raise a ValueError: a mean of nothing has no value,
    and a NaN would only surface later as a broken table or invalid JSON.
    """
    values = _scores(scores, "scores")
    _check_settings(confidence, resamples)
    mean = float(values.mean())
    if values.size == 1 or np.all(values == values[0]):
        return Interval(mean, mean, mean, confidence)
    means = _resampled_means(values, resamples, np.random.default_rng(seed))
    low, high = _percentiles(means, confidence)
    return Interval(mean, low, high, confidence)


def paired_difference(
    a, b, *, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> PairedDifference:
    """Compare per-sample scores `b` against `a` (the same samples, in the same order).

    The interval is always the paired bootstrap percentile interval of mean(b - a). The
    p-value, for a two-sided test of "no difference":

    - both binary: the exact McNemar test, a two-sided binomial test (p = 1/2) on the
      discordant pairs (samples that one side got right and the other wrong); p = 1 when
      there are none. Concordant pairs carry no information about which model is better.
    - otherwise: the paired bootstrap, shifted to the null. The differences d are centered
      (d - mean(d)) so that they satisfy "no difference" while keeping their spread; the
      p-value is twice the share of centered resampled means at least as far out as the
      observed mean on its side, with the (count + 1) / (resamples + 1) correction, so it is
      never exactly 0 (a resampling test cannot show p below 1 / (resamples + 1)). The
      centered resampled means are the uncentered ones minus mean(d), so the same resamples
      give the interval and the p-value.
    """
    first, second = _scores(a, "a"), _scores(b, "b")
    if first.size != second.size:
        raise ValueError(f"paired scores need equal lengths, got {first.size} and {second.size}")
    _check_settings(confidence, resamples)
    diffs = second - first
    diff = float(diffs.mean())
    if np.all(diffs == diffs[0]):
        # No spread to resample: every resample would give exactly `diff`.
        low = high = diff
        means = np.full(resamples, diff)
    else:
        means = _resampled_means(diffs, resamples, np.random.default_rng(seed))
        low, high = _percentiles(means, confidence)
    b_wins, a_wins = int(np.sum(diffs > 0)), int(np.sum(diffs < 0))
    if is_binary(first) and is_binary(second):
        test, p_value = MCNEMAR, mcnemar_exact_p(b_wins, a_wins)
    else:
        test, p_value = PAIRED_BOOTSTRAP, _shifted_null_p(means, diff)
    return PairedDifference(
        mean_a=float(first.mean()),
        mean_b=float(second.mean()),
        diff=diff,
        low=low,
        high=high,
        p_value=p_value,
        test=test,
        n=int(first.size),
        b_wins=b_wins,
        a_wins=a_wins,
    )


def mcnemar_exact_p(b_wins: int, a_wins: int) -> float:
    """Two-sided exact McNemar p-value: binomial(k, n, 1/2) on the discordant counts.

    For p = 1/2 the binomial is symmetric, so the two-sided p-value (the probability of any
    outcome no more likely than the observed one, as scipy's binomtest defines it) is twice
    the smaller tail, capped at 1. The tail is summed in log space, which stays accurate for
    tens of thousands of discordant pairs where exact integer sums get slow.
    """
    total = b_wins + a_wins
    smaller = min(b_wins, a_wins)
    if total == 0 or 2 * smaller == total:
        return 1.0
    steps = np.arange(1, smaller + 1, dtype=float)
    log_comb = np.concatenate(([0.0], np.cumsum(np.log((total - steps + 1) / steps))))
    top = log_comb.max()
    log_tail = top + math.log(float(np.exp(log_comb - top).sum())) - total * math.log(2.0)
    return min(1.0, 2.0 * math.exp(log_tail))


def _shifted_null_p(means: np.ndarray, diff: float) -> float:
    """Two-sided bootstrap p-value of `diff` against the resampled means shifted to 0."""
    null = means - diff
    upper = int(np.sum(null >= diff))
    lower = int(np.sum(null <= diff))
    tail = (min(upper, lower) + 1) / (null.size + 1)
    return min(1.0, 2.0 * tail)


def _resampled_means(values: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """`resamples` bootstrap means of `values` (each a mean of len(values) draws)."""
    distinct, counts = np.unique(values, return_counts=True)
    n = values.size
    if distinct.size <= _MAX_DISTINCT_FOR_COUNTS:
        drawn = rng.multinomial(n, counts / n, size=resamples)
        return drawn @ distinct / n
    rows = max(1, _CHUNK_ELEMENTS // n)
    chunks = []
    for start in range(0, resamples, rows):
        size = min(rows, resamples - start)
        chunks.append(values[rng.integers(0, n, size=(size, n))].mean(axis=1))
    return np.concatenate(chunks)


def _percentiles(means: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


def _scores(scores, name: str) -> np.ndarray:
    values = np.asarray(scores, dtype=float).reshape(-1)
    if values.size == 0:
        raise ValueError(f"{name}: no scores to summarize")
    if not np.all(np.isfinite(values)):
        bad = int(np.sum(~np.isfinite(values)))
        raise ValueError(f"{name}: {bad} of {values.size} scores are NaN or infinite")
    return values


def _check_settings(confidence: float, resamples: int) -> None:
    # These come from flags (--confidence, --bootstrap_resamples): a bad value is the user's.
    if not 0.0 < confidence < 1.0:
        raise ConfigError(
            f"--confidence must be between 0 and 1 (exclusive), got {confidence}: use e.g. 0.95"
        )
    if int(resamples) != resamples or resamples < 1:
        raise ConfigError(
            f"--bootstrap_resamples must be a positive integer, got {resamples}: use e.g. 10000"
        )
