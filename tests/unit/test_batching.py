"""Data order: shuffled micro-batches per epoch, step arithmetic, and exact mid-epoch resume."""

from itertools import islice

import pytest

from swiftlm.train.batching import (
    DataPosition,
    epoch_micro_batches,
    iterate_steps,
    steps_per_epoch,
    total_steps,
)


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
