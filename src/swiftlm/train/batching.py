"""Deterministic data order: which samples form each micro-batch and optimizer step.

The order is a pure function of (seed, epoch), so a position (epoch, micro-batch index) is
all that resume needs: no sampler state, no replaying of skipped batches.

Three ways to cut an epoch into micro-batches, all under the same interface (`BatchPlan`):
- fixed size: `batch_size` rows per rank, one sample per row (the default);
- `--packing`: samples are bin-packed once into rows of at most `max_length` tokens (best-fit
  decreasing); the rows are then shuffled and cut like samples;
- `--max_tokens_per_batch`: rows are grouped by length and a micro-batch takes rows until its
  padded size (or, padding-free, its token count) would pass the budget.

A global micro-batch holds one micro-batch per data-parallel rank; a rank's micro-batch is a
list of rows and a row is a list of sample indices (one sample unless packed).
"""

import bisect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

Row = list[int]
RankBatch = list[Row]
GlobalBatch = list[RankBatch]

# Budget mode sorts rows by length inside buckets of this many rows: big enough that
# neighbours have similar lengths, small enough that batches still mix the epoch's order.
BUCKET_ROWS = 512


@dataclass(frozen=True)
class DataPosition:
    """Where the next optimizer step starts reading."""

    epoch: int = 0
    micro_batch: int = 0


def micro_batch_units(plan: "BatchPlan") -> int:
    """What one global micro-batch of `plan` holds, in the unit that stays the same when the
    data-parallel size changes: rows (fixed size, packed rows: an epoch is one permutation of
    the rows, cut into global micro-batches of batch_size x dp_size), or rank micro-batches
    (a token budget: the epoch's budget micro-batches, taken dp_size at a time)."""
    return plan.dp_size if plan.max_tokens else plan.batch_size * plan.dp_size


def convert_position(position: DataPosition, saved_units: int, units: int) -> DataPosition:
    """`position`, saved when a global micro-batch held `saved_units` (`micro_batch_units`),
    as the index of the same place in the epoch when it holds `units`: 3 micro-batches of
    2 ranks x 2 rows are 12 rows, 6 micro-batches on one rank. A position that falls inside a
    micro-batch of the new size cannot be continued exactly: ValueError."""
    consumed = position.micro_batch * saved_units
    if consumed % units:
        raise ValueError(
            f"micro-batch {position.micro_batch} of epoch {position.epoch} ({consumed} rows or "
            f"micro-batches of {saved_units} per global micro-batch) is not a whole number of "
            f"global micro-batches of {units}"
        )
    return DataPosition(position.epoch, consumed // units)


def pack_best_fit_decreasing(lengths: list[int], capacity: int) -> list[Row]:
    """Bins of sample indices whose lengths sum to at most `capacity`.

    Longest first, each into the fullest bin it still fits (best fit), which wastes at most a
    few percent on real length distributions. Deterministic: ties keep index order.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[Row] = []
    free_keys: list[tuple[int, int]] = []  # sorted (free space, bin id)
    for index in order:
        size = min(lengths[index], capacity)
        at = bisect.bisect_left(free_keys, (size, -1))
        if at == len(free_keys):
            bins.append([index])
            bisect.insort(free_keys, (capacity - size, len(bins) - 1))
            continue
        free, bin_id = free_keys.pop(at)
        bins[bin_id].append(index)
        bisect.insort(free_keys, (free - size, bin_id))
    return bins


@dataclass(frozen=True)
class BatchPlan:
    """How the samples of an epoch become global micro-batches."""

    lengths: tuple[int, ...]  # tokens of every sample
    batch_size: int = 1  # rows per rank micro-batch (fixed-size mode)
    dp_size: int = 1
    seed: int = 42
    packs: tuple[tuple[int, ...], ...] | None = None  # rows of --packing
    max_tokens: int = 0  # token budget per rank micro-batch (0: fixed size)
    padding_free: bool = False  # a micro-batch is one flat row: its cost is its token count
    _last_epoch: list = field(default_factory=lambda: [None, None], compare=False, repr=False)

    @property
    def rows(self) -> list[Row]:
        if self.packs is not None:
            return [list(p) for p in self.packs]
        return [[i] for i in range(len(self.lengths))]

    def row_length(self, row: Row) -> int:
        return sum(self.lengths[i] for i in row)

    def epoch_batches(self, epoch: int) -> list[GlobalBatch]:
        # Planning an epoch takes tens of milliseconds on big datasets and the loop asks for
        # the same epoch several times (step count, log line, iteration): remember the last.
        if self._last_epoch[0] != epoch:
            self._last_epoch[:] = [epoch, self._plan_epoch(epoch)]
        return self._last_epoch[1]

    def _plan_epoch(self, epoch: int) -> Sequence[GlobalBatch]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        if self.packs is None and not self.max_tokens:  # one sample per row: cut lazily
            order = torch.randperm(len(self.lengths), generator=generator).numpy()
            return FixedSizeEpoch(order, self.batch_size, self.dp_size)
        rows = self.rows
        order = torch.randperm(len(rows), generator=generator).tolist()
        if self.max_tokens:
            rank_batches = self._budget_batches([rows[i] for i in order], generator)
            size = self.dp_size
            return [rank_batches[i : i + size] for i in range(0, len(rank_batches), size)]
        per_global = self.batch_size * self.dp_size
        return [
            self._split_ranks([rows[i] for i in order[start : start + per_global]])
            for start in range(0, len(order), per_global)
        ]

    def _split_ranks(self, rows: list[Row]) -> GlobalBatch:
        """Rank r takes rows [r*b, (r+1)*b); a short last batch leaves late ranks empty."""
        b = self.batch_size
        return [rows[r * b : (r + 1) * b] for r in range(self.dp_size)]

    def _cost(self, rows_in_batch: int, longest: int, tokens: int) -> int:
        return tokens if self.padding_free else rows_in_batch * longest

    def _budget_batches(self, rows: list[Row], generator: torch.Generator) -> list[RankBatch]:
        """Fill micro-batches up to the token budget from length-sorted buckets, then shuffle
        the micro-batches so consecutive steps do not all have the same length."""
        batches: list[RankBatch] = []
        for start in range(0, len(rows), BUCKET_ROWS):
            bucket = sorted(rows[start : start + BUCKET_ROWS], key=self.row_length, reverse=True)
            current: RankBatch = []
            longest = tokens = 0
            for row in bucket:
                length = self.row_length(row)
                cost = self._cost(len(current) + 1, max(longest, length), tokens + length)
                if current and cost > self.max_tokens:
                    batches.append(current)
                    current, longest, tokens = [], 0, 0
                current.append(row)
                longest, tokens = max(longest, length), tokens + length
            if current:
                batches.append(current)
        order = torch.randperm(len(batches), generator=generator).tolist()
        return [batches[i] for i in order]


class FixedSizeEpoch(Sequence):
    """The global micro-batches of a fixed-size epoch, built when asked for: an epoch of
    millions of samples (pre-training chunks) is one permutation array, not millions of
    lists, so planning it and resuming in the middle of it take milliseconds."""

    def __init__(self, order: np.ndarray, batch_size: int, dp_size: int):
        self.order, self.batch_size, self.dp_size = order, batch_size, dp_size
        self.per_global = batch_size * dp_size

    def __len__(self) -> int:
        return -(-len(self.order) // self.per_global)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        start = (index % len(self)) * self.per_global
        rows = [[i] for i in self.order[start : start + self.per_global].tolist()]
        b = self.batch_size  # rank r takes rows [r*b, (r+1)*b); a short last batch leaves
        return [rows[r * b : (r + 1) * b] for r in range(self.dp_size)]  # late ranks empty

    def __eq__(self, other) -> bool:
        return list(self) == list(other)


@dataclass(frozen=True)
class EpochTotals:
    """An epoch's rank micro-batches as totals: what the log line and data health report."""

    micro_batches: int
    rows: int
    real_tokens: int  # tokens of the samples
    held_tokens: int  # what the micro-batches hold: padded to their longest row (or real)


def epoch_totals(plan: "BatchPlan", epoch: int = 0) -> EpochTotals:
    """The non-empty rank micro-batches of `epoch`, counted; vectorized for fixed size."""
    batches = plan.epoch_batches(epoch)
    if isinstance(batches, FixedSizeEpoch):
        lengths = np.asarray(plan.lengths, dtype=np.int64)[batches.order]
        size, whole = plan.batch_size, len(lengths) // plan.batch_size
        longest = lengths[: whole * size].reshape(whole, size).max(axis=1).sum() * size
        tail = lengths[whole * size :]
        held = int(longest) + (len(tail) * int(tail.max()) if len(tail) else 0)
        micro = whole + (1 if len(tail) else 0)
        real = int(lengths.sum())
        return EpochTotals(micro, len(lengths), real, real if plan.padding_free else held)
    micro = [[plan.row_length(r) for r in b] for g in batches for b in g if b]
    real = sum(sum(b) for b in micro)
    held = real if plan.padding_free else sum(len(b) * max(b) for b in micro)
    return EpochTotals(len(micro), sum(len(b) for b in micro), real, held)


def simple_plan(num_samples: int, batch_size: int, seed: int) -> BatchPlan:
    """Fixed-size batches over samples whose lengths do not matter (one rank)."""
    return BatchPlan(lengths=(1,) * num_samples, batch_size=batch_size, seed=seed)


def steps_in_epoch(plan: BatchPlan, accumulation: int, epoch: int) -> int:
    return math.ceil(len(plan.epoch_batches(epoch)) / accumulation)


def total_steps(plan: BatchPlan, accumulation: int, epochs: float, max_steps: int) -> int:
    """Optimizer steps of the run: --max_steps, else the steps of `epochs` epochs (a partial
    epoch rounds its steps up). With a token budget epochs can differ by a step or two."""
    if max_steps > 0:
        return max_steps
    whole, fraction = int(epochs), epochs - int(epochs)
    steps = sum(steps_in_epoch(plan, accumulation, e) for e in range(whole))
    if fraction > 0:
        # Round first: 0.07 * 100 is 7.000000000000001 in floating point, not a reason for 8.
        steps += math.ceil(round(fraction * steps_in_epoch(plan, accumulation, whole), 6))
    return max(1, steps)


def iterate_steps(
    plan: BatchPlan, accumulation: int, start: DataPosition
) -> Iterator[tuple[list[GlobalBatch], DataPosition]]:
    """Yield (global micro-batches of one optimizer step, position after it), forever.

    A step never crosses an epoch boundary; the last step of an epoch may have fewer
    micro-batches (the loss normalization by label tokens keeps it unbiased).
    """
    epoch, index = start.epoch, start.micro_batch
    while True:
        batches = plan.epoch_batches(epoch)
        while index < len(batches):
            step_batches = batches[index : index + accumulation]
            index += len(step_batches)
            position = (
                DataPosition(epoch, index) if index < len(batches) else DataPosition(epoch + 1, 0)
            )
            yield step_batches, position
        epoch, index = epoch + 1, 0


def build_batch_plan(
    lengths: list[int],
    batch_size: int,
    dp_size: int,
    seed: int,
    *,
    pack_to: int = 0,
    max_tokens: int = 0,
    padding_free: bool = False,
) -> BatchPlan:
    """The plan of a run; `pack_to` > 0 bin-packs the samples into rows of that many tokens."""
    packs = None
    if pack_to:
        packs = tuple(tuple(row) for row in pack_best_fit_decreasing(lengths, pack_to))
    return BatchPlan(
        lengths=tuple(lengths),
        batch_size=batch_size,
        dp_size=dp_size,
        seed=seed,
        packs=packs,
        max_tokens=max_tokens,
        padding_free=padding_free,
    )


def describe_plan(plan: BatchPlan, pack_to: int) -> str:
    """One log line: how full the rows are and how much of a micro-batch is padding."""
    totals = epoch_totals(plan)
    parts = [f"{totals.micro_batches} micro-batches per epoch"]
    if plan.packs is not None:
        fill = totals.real_tokens / (len(plan.packs) * pack_to)
        parts.append(
            f"{len(plan.lengths)} samples packed into {len(plan.packs)} rows "
            f"({100 * fill:.1f}% full)"
        )
    padding = 1 - totals.real_tokens / totals.held_tokens
    parts.append(f"padding {100 * padding:.1f}% of computed tokens")
    return "batches: " + ", ".join(parts)
