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
from collections.abc import Iterator
from dataclasses import dataclass, field

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

    def _plan_epoch(self, epoch: int) -> list[GlobalBatch]:
        rows = self.rows
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
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
    batches = [b for g in plan.epoch_batches(0) for b in g if b]
    tokens = sum(plan.lengths)
    if plan.padding_free:
        computed = tokens
    else:
        computed = sum(len(b) * max(plan.row_length(r) for r in b) for b in batches)
    parts = [f"{len(batches)} micro-batches per epoch"]
    if plan.packs is not None:
        fill = tokens / (len(plan.packs) * pack_to)
        parts.append(
            f"{len(plan.lengths)} samples packed into {len(plan.packs)} rows "
            f"({100 * fill:.1f}% full)"
        )
    parts.append(f"padding {100 * (1 - tokens / computed):.1f}% of computed tokens")
    return "batches: " + ", ".join(parts)
