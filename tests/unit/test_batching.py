"""Data order: shuffled micro-batches per epoch, step arithmetic, and exact mid-epoch resume."""

import math
from itertools import islice

import pytest
import torch

from swiftlm.train import batching
from swiftlm.train.batching import DataPosition, simple_plan


# The fixed-size plan on one rank, in the shapes these tests were written for: a micro-batch
# is a list of sample indices.
def _indices(global_batch):
    return [row[0] for row in global_batch[0]]


def epoch_micro_batches(num_samples, batch_size, seed, epoch):
    plan = simple_plan(num_samples, batch_size, seed)
    return [_indices(g) for g in plan.epoch_batches(epoch)]


def steps_per_epoch(num_samples, batch_size, accumulation):
    return batching.steps_in_epoch(simple_plan(num_samples, batch_size, 0), accumulation, 0)


def total_steps(num_samples, batch_size, accumulation, epochs, max_steps):
    plan = simple_plan(num_samples, batch_size, 0)
    return batching.total_steps(plan, accumulation, epochs, max_steps)


def iterate_steps(num_samples, batch_size, accumulation, seed, start):
    plan = simple_plan(num_samples, batch_size, seed)
    for step, position in batching.iterate_steps(plan, accumulation, start):
        yield [_indices(g) for g in step], position


@pytest.mark.parametrize(
    ("num_samples", "batch_size", "sizes"),
    [
        (10, 3, [3, 3, 3, 1]),
        (12, 4, [4, 4, 4]),
        (5, 8, [5]),
        (1, 1, [1]),
        (7, 1, [1] * 7),
    ],
)
def test_epoch_covers_every_index_once(num_samples, batch_size, sizes):
    for epoch in range(3):
        batches = epoch_micro_batches(num_samples, batch_size, seed=42, epoch=epoch)
        assert [len(b) for b in batches] == sizes
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(num_samples))


def test_epoch_order_is_a_function_of_seed_and_epoch():
    first = epoch_micro_batches(50, 4, seed=3, epoch=1)
    assert epoch_micro_batches(50, 4, seed=3, epoch=1) == first
    assert epoch_micro_batches(50, 4, seed=3, epoch=0) != first
    assert epoch_micro_batches(50, 4, seed=3, epoch=2) != first
    assert epoch_micro_batches(50, 4, seed=4, epoch=1) != first
    # Shuffled, not the identity order.
    assert [i for b in first for i in b] != list(range(50))
    # The batch size only cuts the same order differently.
    assert [i for b in epoch_micro_batches(50, 7, seed=3, epoch=1) for i in b] == [
        i for b in first for i in b
    ]


def test_all_epochs_differ():
    orders = {tuple(i for b in epoch_micro_batches(20, 2, 0, e) for i in b) for e in range(10)}
    assert len(orders) == 10


@pytest.mark.parametrize(
    ("num_samples", "batch_size", "accumulation", "expected"),
    [
        (10, 3, 2, 2),  # 4 micro-batches -> steps of 2 + 2
        (10, 3, 3, 2),  # 4 micro-batches -> 3 + 1
        (12, 3, 4, 1),
        (12, 4, 1, 3),
        (1, 8, 4, 1),
        (100, 4, 8, 4),  # 25 micro-batches -> 8 + 8 + 8 + 1
        (24, 1, 1, 24),
    ],
)
def test_steps_per_epoch(num_samples, batch_size, accumulation, expected):
    assert steps_per_epoch(num_samples, batch_size, accumulation) == expected


@pytest.mark.parametrize(
    ("epochs", "max_steps", "expected"),
    [
        (3.0, -1, 12),  # 4 steps per epoch
        (1.0, -1, 4),
        (0.5, -1, 2),
        (1.5, -1, 6),
        (0.3, -1, 2),  # 1.2 steps -> a partial step rounds up
        (2.1, -1, 9),  # 8.4 -> 9
        (0.01, -1, 1),
        (0.0, -1, 1),  # never zero steps
        (3.0, 7, 7),  # max_steps wins
        (0.5, 100, 100),
        (3.0, 0, 12),  # 0 does not override
    ],
)
def test_total_steps(epochs, max_steps, expected):
    assert total_steps(100, 4, 8, epochs, max_steps) == expected


@pytest.mark.parametrize(
    ("epochs", "spe", "expected"), [(0.07, 100, 7), (0.14, 50, 7), (0.28, 25, 7)]
)
def test_total_steps_fractional_epochs_exact(epochs, spe, expected):
    assert steps_per_epoch(spe, 1, 1) == spe
    assert total_steps(spe, 1, 1, epochs, -1) == expected


def take(num_samples, batch_size, accumulation, seed, start, count):
    return list(islice(iterate_steps(num_samples, batch_size, accumulation, seed, start), count))


def test_steps_follow_the_epoch_order_exactly():
    # 10 samples, batch 3 -> 4 micro-batches per epoch; accumulation 3 -> steps of 3 then 1.
    got = take(10, 3, 3, seed=7, start=DataPosition(), count=6)
    e0 = epoch_micro_batches(10, 3, 7, 0)
    e1 = epoch_micro_batches(10, 3, 7, 1)
    e2 = epoch_micro_batches(10, 3, 7, 2)
    assert got == [
        (e0[0:3], DataPosition(0, 3)),
        (e0[3:4], DataPosition(1, 0)),
        (e1[0:3], DataPosition(1, 3)),
        (e1[3:4], DataPosition(2, 0)),
        (e2[0:3], DataPosition(2, 3)),
        (e2[3:4], DataPosition(3, 0)),
    ]
    # The last step of an epoch is short: one micro-batch holding a single sample.
    assert [len(b) for b in got[1][0]] == [1]


@pytest.mark.parametrize(
    ("num_samples", "batch_size", "accumulation"),
    [(10, 3, 3), (10, 3, 2), (23, 2, 4), (12, 4, 3), (5, 8, 2), (9, 1, 1)],
)
def test_steps_never_cross_an_epoch_boundary(num_samples, batch_size, accumulation):
    per_epoch = steps_per_epoch(num_samples, batch_size, accumulation)
    steps = take(num_samples, batch_size, accumulation, 1, DataPosition(), per_epoch * 3)
    for epoch in range(3):
        epoch_steps = steps[epoch * per_epoch : (epoch + 1) * per_epoch]
        assert all(len(batches) <= accumulation for batches, _ in epoch_steps)
        assert all(len(batches) == accumulation for batches, _ in epoch_steps[:-1])
        joined = [b for batches, _ in epoch_steps for b in batches]
        assert joined == epoch_micro_batches(num_samples, batch_size, 1, epoch)
        # Positions inside the epoch, then the start of the next one.
        assert [p.epoch for _, p in epoch_steps[:-1]] == [epoch] * (per_epoch - 1)
        assert epoch_steps[-1][1] == DataPosition(epoch + 1, 0)


@pytest.mark.parametrize(
    ("num_samples", "batch_size", "accumulation"), [(10, 3, 3), (23, 2, 4), (9, 1, 2)]
)
def test_resume_from_any_position_continues_the_same_stream(num_samples, batch_size, accumulation):
    full = take(num_samples, batch_size, accumulation, 5, DataPosition(), 20)
    for i, (_, position) in enumerate(full[:-5]):
        resumed = take(num_samples, batch_size, accumulation, 5, position, 5)
        assert resumed == full[i + 1 : i + 6], f"resume after step {i + 1} from {position}"


def test_resume_mid_epoch_position_explicitly():
    e0 = epoch_micro_batches(23, 2, 5, 0)  # 12 micro-batches: steps of 4, 4, 4
    e1 = epoch_micro_batches(23, 2, 5, 1)
    resumed = take(23, 2, 4, 5, DataPosition(epoch=0, micro_batch=8), 2)
    assert resumed == [(e0[8:12], DataPosition(1, 0)), (e1[0:4], DataPosition(1, 4))]


def test_data_position_defaults_and_is_immutable():
    assert DataPosition() == DataPosition(0, 0)
    with pytest.raises(AttributeError):
        DataPosition().epoch = 1  # type: ignore[misc]


# --- packing and token budgets -------------------------------------------------------------

LENGTHS = [
    int(x) for x in torch.randint(5, 500, (300,), generator=torch.Generator().manual_seed(0))
]


def test_best_fit_decreasing_packs_every_sample_once_within_capacity():
    bins = batching.pack_best_fit_decreasing(LENGTHS, 512)
    assert sorted(i for b in bins for i in b) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i] for i in b) <= 512 for b in bins)
    # Any-fit packing leaves at most one bin half empty, and lands near the lower bound
    # (samples over half the capacity cannot share a bin).
    fills = [sum(LENGTHS[i] for i in b) for b in bins]
    assert sum(f <= 256 for f in fills) <= 1
    lower_bound = max(math.ceil(sum(LENGTHS) / 512), sum(n > 256 for n in LENGTHS))
    assert len(bins) <= lower_bound * 1.1
    assert batching.pack_best_fit_decreasing(LENGTHS, 512) == bins  # deterministic


def test_best_fit_chooses_the_fullest_bin_that_fits():
    # 6 -> bin A (free 4), 5 -> bin B (free 5), 4 -> A (fullest that fits), 3 -> B.
    assert batching.pack_best_fit_decreasing([6, 5, 4, 3], 10) == [[0, 2], [1, 3]]


def _plan(**kw):
    return batching.build_batch_plan(LENGTHS, kw.pop("batch_size", 2), kw.pop("dp", 1), 3, **kw)


def _flat_samples(plan, epoch):
    return [i for g in plan.epoch_batches(epoch) for b in g for row in b for i in row]


@pytest.mark.parametrize(
    "kw",
    [
        dict(pack_to=512),
        dict(max_tokens=1024),
        dict(max_tokens=1024, padding_free=True),
        dict(pack_to=512, max_tokens=2048),
        dict(max_tokens=1024, dp=2),
        dict(pack_to=512, dp=3, batch_size=1),
    ],
)
def test_every_plan_covers_each_sample_once_per_epoch(kw):
    plan = _plan(**kw)
    for epoch in range(2):
        assert sorted(_flat_samples(plan, epoch)) == list(range(len(LENGTHS)))
    assert _flat_samples(plan, 0) != _flat_samples(plan, 1)  # reshuffled
    assert plan.epoch_batches(1) == _plan(**kw).epoch_batches(1)  # a function of seed + epoch


@pytest.mark.parametrize("padding_free", [False, True])
def test_token_budget_is_respected(padding_free):
    plan = _plan(max_tokens=1024, padding_free=padding_free)
    batches = [g[0] for g in plan.epoch_batches(0)]
    for batch in batches:
        lengths = [plan.row_length(r) for r in batch]
        cost = sum(lengths) if padding_free else len(batch) * max(lengths)
        assert cost <= 1024 or len(batch) == 1
    # Sorted buckets keep padding low: under 10% of computed tokens here, versus about 40%
    # for random batches of the same lengths.
    if not padding_free:
        computed = sum(len(b) * max(plan.row_length(r) for r in b) for b in batches)
        assert 1 - sum(LENGTHS) / computed < 0.10


def test_token_budget_batches_are_shuffled_not_sorted():
    plan = _plan(max_tokens=1024)
    longest = [max(plan.row_length(r) for r in g[0]) for g in plan.epoch_batches(0)]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)


def test_data_parallel_ranks_get_disjoint_budgeted_batches():
    plan = _plan(max_tokens=1024, dp=2)
    for global_batch in plan.epoch_batches(0)[:-1]:
        assert len(global_batch) == 2 and all(global_batch)
        first, second = ({i for row in batch for i in row} for batch in global_batch)
        assert not first & second  # no sample on both ranks
        for batch in global_batch:  # each rank's share within the budget
            assert len(batch) * max(plan.row_length(r) for r in batch) <= 1024 or len(batch) == 1


@pytest.mark.parametrize("kw", [dict(pack_to=512), dict(max_tokens=1500)])
def test_resume_of_packed_and_budgeted_plans(kw):
    plan = _plan(**kw)
    full = list(islice(batching.iterate_steps(plan, 3, DataPosition()), 40))
    for i in (0, 7, 20):
        resumed = list(islice(batching.iterate_steps(plan, 3, full[i][1]), 5))
        assert resumed == full[i + 1 : i + 6]


def test_describe_plan_reports_fill_and_padding():
    text = batching.describe_plan(_plan(pack_to=512), 512)
    assert "300 samples packed into" in text and "% full" in text and "padding" in text
