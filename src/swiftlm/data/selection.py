"""Which rows make each split, decided from row counts alone, so that large datasets need not
be held in memory to be mixed, sampled and split.

A first pass (`scan`) reads and validates every row of every spec, keeping only counts (and
the first bad rows' messages). The selection then applies the same seeded functions as
loading.load_samples and loading.split_samples (`sample_indices`, `held_out_indices`) to the
counts, so a split holds the very samples, in the very order, that the in-memory path gives.
A second pass (`iter_samples`) reads the files again and yields the chosen samples in order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from swiftlm.data.loading import (
    LoadReport,
    checked_sample,
    held_out_indices,
    sample_indices,
)
from swiftlm.data.sources import parse_dataset_spec, read_rows
from swiftlm.errors import DataError


@dataclass
class Part:
    """Valid rows of one dataset taken into a split: `picks` are ordinals among the dataset's
    valid rows (0 = its first valid row), in sample order."""

    path: str
    picks: np.ndarray


@dataclass
class Selection:
    """The samples of one split, in order, as parts of datasets."""

    parts: list[Part]

    def __len__(self) -> int:
        return sum(len(part.picks) for part in self.parts)


def scan(specs: list[str], to_sample: Callable[[dict], dict], report: LoadReport) -> list[int]:
    """Read and validate every row of every spec (the first pass); the count of valid rows per
    spec. Bad rows, rows read and unused columns go to `report`, as load_samples records them."""
    counts = []
    for spec in specs:
        path, _ = parse_dataset_spec(spec)
        valid = 0
        for row in read_rows(path):
            report.rows_read[row.source] += 1
            valid += checked_sample(row, to_sample, report) is not None
        counts.append(valid)
    return counts


def select(
    specs: list[str],
    to_sample: Callable[[dict], dict],
    report: LoadReport,
    *,
    skip_bad_rows: bool,
    seed: int,
) -> Selection:
    """The samples load_samples(specs, ...) would return, as a Selection (rows not kept)."""
    counts = scan(specs, to_sample, report)
    report.settle_bad_rows(skip_bad_rows)
    parts = []
    for spec, valid in zip(specs, counts, strict=True):
        path, count = parse_dataset_spec(spec)
        if count is None:
            picks = np.arange(valid, dtype=np.int64)
        else:
            picks = np.asarray(sample_indices(valid, count, f"{seed}:{spec}"), dtype=np.int64)
        report.samples[spec] = len(picks)
        parts.append(Part(path, picks))
    selection = Selection(parts)
    if not len(selection):
        raise DataError(f"no valid samples in dataset(s) {', '.join(specs) or '(none given)'}")
    return selection


def split_selection(selection: Selection, ratio: float, seed: int) -> tuple[Selection, Selection]:
    """(train, validation) as split_samples(samples, ratio, seed) makes them."""
    held_out = held_out_indices(len(selection), ratio, seed)
    if not held_out:
        return selection, Selection([])
    positions = np.zeros(len(selection), dtype=bool)
    positions[np.fromiter(held_out, dtype=np.int64, count=len(held_out))] = True
    train, val, start = [], [], 0
    for part in selection.parts:
        mask = positions[start : start + len(part.picks)]
        start += len(part.picks)
        train.append(Part(part.path, part.picks[~mask]))
        val.append(Part(part.path, part.picks[mask]))
    return Selection(train), Selection(val)


def iter_samples(selection: Selection, to_sample: Callable[[dict], dict]) -> Iterator[dict]:
    """The selected samples in order (the second pass): each increasing run of a part's picks
    is one read through its dataset, so a dataset taken twice (`path#N` above its size) is
    read twice, and only the sample being yielded is held."""
    for part in selection.parts:
        for run in _increasing_runs(part.picks):
            yield from _read_picks(part.path, run, to_sample)


def _increasing_runs(picks: np.ndarray) -> list[np.ndarray]:
    if not len(picks):
        return []
    breaks = np.flatnonzero(picks[1:] <= picks[:-1]) + 1
    return np.split(picks, breaks)


def _read_picks(path: str, run: np.ndarray, to_sample: Callable[[dict], dict]) -> Iterator[dict]:
    wanted = map(int, run)  # lazily: a list of a million picks would be 36 MB
    target = next(wanted)
    ordinal = 0
    for row in read_rows(path):
        sample = checked_sample(row, to_sample, None)
        if sample is None:
            continue
        if ordinal == target:
            yield sample
            target = next(wanted, None)
            if target is None:
                return
        ordinal += 1
    raise DataError(
        f"{path} changed while it was read: it has fewer valid rows than a moment ago; "
        "run again once the file is no longer being written"
    )


def chunks(samples: Iterator[dict], size: int) -> Iterator[list[dict]]:
    """Lists of up to `size` consecutive samples."""
    chunk = []
    for sample in samples:
        chunk.append(sample)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
