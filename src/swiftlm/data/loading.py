"""Load, validate, sample and split datasets into samples of a method's row schema.

Every row of every dataset is read and validated before anything is returned, so a bad
row stops the run before the first training step, with all bad rows listed as
`file:line: reason`. Columns that the row schema did not read (`id`, `source` ...) are
counted and reported once by LoadReport.notices, never dropped without a word.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from swiftlm.data.columns import given
from swiftlm.data.formats import RowError, columns_read
from swiftlm.data.images import relative_to
from swiftlm.data.sources import NOT_AN_OBJECT, RawRow, parse_dataset_spec, read_rows
from swiftlm.errors import DataError

MAX_LISTED_BAD_ROWS = 20
# Bad rows kept with their full message; beyond this they are only counted (by kind), so a
# dataset of millions of bad rows does not hold millions of messages.
MAX_KEPT_BAD_ROWS = 1000


@dataclass(frozen=True)
class BadRow:
    """A row that failed validation: where it is, why, and the RowError kind for counting."""

    source: str
    line: int
    reason: str
    kind: str = ""


@dataclass
class LoadReport:
    """What loading read and dropped.

    `rows_read` counts rows per source file (hub id for hub datasets); `samples` counts the
    samples each spec contributed after `#N` sampling; `skipped` counts dropped rows by
    RowError kind; `unused_columns` counts, per column, the valid rows that filled a column the
    row schema did not read. `bad_rows` keeps the first MAX_KEPT_BAD_ROWS bad rows;
    `bad_kinds` counts them all by kind.
    """

    rows_read: Counter[str] = field(default_factory=Counter)
    samples: dict[str, int] = field(default_factory=dict)
    skipped: Counter[str] = field(default_factory=Counter)
    bad_rows: list[BadRow] = field(default_factory=list)
    unused_columns: Counter[str] = field(default_factory=Counter)
    bad_kinds: Counter[str] = field(default_factory=Counter)

    def add_bad_row(self, row: BadRow) -> None:
        self.bad_kinds[row.kind] += 1
        if len(self.bad_rows) < MAX_KEPT_BAD_ROWS:
            self.bad_rows.append(row)

    @property
    def bad_row_count(self) -> int:
        return sum(self.bad_kinds.values())

    def settle_bad_rows(self, skip_bad_rows: bool) -> None:
        """Raise DataValidationError for the bad rows, or count them as skipped."""
        if not self.bad_row_count:
            return
        if not skip_bad_rows:
            raise DataValidationError(self.bad_rows, self.total_rows, self.bad_row_count)
        self.skipped.update(self.bad_kinds)

    @property
    def total_rows(self) -> int:
        return sum(self.rows_read.values())

    def summary(self) -> str:
        """One line, e.g. "skipped 3 bad rows: 2 empty assistant answer, 1 invalid JSON"."""
        total = sum(self.skipped.values())
        if not total:
            return "no bad rows"
        ranked = sorted(self.skipped.items(), key=lambda item: (-item[1], item[0]))
        counts = ", ".join(f"{count} {kind}" for kind, count in ranked)
        return f"skipped {total} bad row{'s' if total != 1 else ''}: {counts}"

    def notices(self, method: str) -> list[str]:
        """Lines for the data log about what was read but not used, e.g.
        "data: columns not used by sft: id (120 rows), source (120 rows)"; empty if none."""
        if not self.unused_columns:
            return []
        ranked = sorted(self.unused_columns.items(), key=lambda item: (-item[1], item[0]))
        columns = ", ".join(f"{name} ({_rows(count)})" for name, count in ranked)
        return [f"data: columns not used by {method}: {columns}"]


def _rows(count: int) -> str:
    return f"{count} row{'s' if count != 1 else ''}"


class DataValidationError(DataError):
    """Some rows are invalid; the message lists the first ones as `file:line: reason`."""

    def __init__(self, bad_rows: list[BadRow], total: int, count: int | None = None):
        """`bad_rows`: the first bad rows (all, or the kept ones of `count` in all)."""
        self.bad_rows = bad_rows
        self.total = total
        count = len(bad_rows) if count is None else count
        lines = [f"{row.source}:{row.line}: {row.reason}" for row in bad_rows[:MAX_LISTED_BAD_ROWS]]
        if count > MAX_LISTED_BAD_ROWS:
            lines.append(f"... and {count - MAX_LISTED_BAD_ROWS} more")
        lines.append(
            f"{count} of {total} rows are invalid; fix them or pass --skip_bad_rows to skip them"
        )
        super().__init__("\n".join(lines))


def load_samples(
    specs: list[str],
    to_sample: Callable[[dict], dict],
    *,
    skip_bad_rows: bool = False,
    seed: int = 42,
) -> tuple[list[dict], LoadReport]:
    """Read, validate and mix datasets into samples, in spec order (the loop shuffles).

    `to_sample(record) -> dict` is the method's row schema (e.g. formats.chat_sample): it
    turns one row into a sample or raises RowError. Loading adds `"source": "path:line"` to
    each sample. Every row of every spec is converted first; bad rows (including invalid
    JSON/CSV and rows that are not objects) raise DataValidationError unless
    `skip_bad_rows`, which drops them and counts them in the report. A `path#N` spec then
    contributes N samples: a seeded subset when N <= its size, otherwise every row repeated
    plus a seeded remainder.
    """
    report = LoadReport()
    per_spec = [_validate(spec, to_sample, report) for spec in specs]
    report.settle_bad_rows(skip_bad_rows)
    samples = []
    for spec, valid in zip(specs, per_spec, strict=True):
        _, count = parse_dataset_spec(spec)
        if count is not None:
            valid = sample_rows(valid, count, seed=f"{seed}:{spec}")
        report.samples[spec] = len(valid)
        samples += valid
    if not samples:
        raise DataError(f"no valid samples in dataset(s) {', '.join(specs) or '(none given)'}")
    return samples, report


def _validate(spec: str, to_sample: Callable[[dict], dict], report: LoadReport) -> list[dict]:
    """Convert every row of one spec; bad rows go to report.bad_rows with their reason."""
    path, _ = parse_dataset_spec(spec)
    valid = []
    for row in read_rows(path):
        report.rows_read[row.source] += 1
        sample = checked_sample(row, to_sample, report)
        if sample is not None:
            valid.append(sample)
    return valid


def checked_sample(row: RawRow, to_sample: Callable[[dict], dict], report: LoadReport | None):
    """The sample of one raw row (with its `source`), or None for a bad row, which goes to
    `report` (when given) with its reason; unused columns are counted in `report` too."""
    try:
        record = _record(row)
        with relative_to(_data_folder(row.source)):  # where a row's image paths start
            sample = to_sample(record)
    except RowError as e:
        if report is not None:
            report.add_bad_row(BadRow(row.source, row.line, str(e), e.kind))
        return None
    if report is not None:
        report.unused_columns.update(_unused_columns(record, sample))
    return {**sample, "source": f"{row.source}:{row.line}"}


def _data_folder(source: str) -> Path | None:
    """The folder of a row's local data file (None for hub datasets)."""
    folder = Path(source).parent
    return folder if folder.is_dir() else None


def _unused_columns(record: dict, sample: dict) -> list[str]:
    """The filled columns of `record` that its sample was not made of (none when the sample
    is of a schema whose columns only its method knows)."""
    read = columns_read(record, sample)
    if read is None:
        return []
    return [column for column, value in record.items() if column not in read and given(value)]


def _record(row: RawRow) -> dict:
    """The parsed object of a raw row; a row that could not be read raises its RowError."""
    if row.record is not None:
        return row.record
    error = row.error or "unreadable row"
    if error == NOT_AN_OBJECT:
        raise RowError("not an object", error)
    raise RowError("invalid CSV" if error.startswith("invalid CSV") else "invalid JSON", error)


def sample_rows(rows: list, count: int, seed: int | str) -> list:
    """Take `count` rows, deterministic for `seed`, keeping file order within each pass.

    count <= len(rows): a random subset without replacement. Otherwise every row
    count // len(rows) times, then a random subset for the remainder (oversampling).
    """
    return [rows[i] for i in sample_indices(len(rows), count, seed)]


def sample_indices(size: int, count: int, seed: int | str) -> list[int]:
    """The indices sample_rows takes from `size` rows: range(size) `count // size` times, then
    the sorted seeded remainder (what decides a `path#N` selection without the rows)."""
    if not size:
        return []
    rng = random.Random(seed)
    repeats, remainder = divmod(count, size)
    picked = sorted(rng.sample(range(size), remainder))
    return [*range(size)] * repeats + picked


def split_samples(samples: list, ratio: float, seed: int) -> tuple[list, list]:
    """Hold out round(ratio * n) samples, chosen by a seeded shuffle, for validation.

    Returns (train, validation), each in the original order. At least one sample is held
    out when ratio > 0 and there are two or more, and at least one is always kept for
    training.
    """
    held_out = held_out_indices(len(samples), ratio, seed)
    train = [s for i, s in enumerate(samples) if i not in held_out]
    val = [s for i, s in enumerate(samples) if i in held_out]
    return train, val


def held_out_indices(n: int, ratio: float, seed: int) -> set[int]:
    """The positions split_samples holds out of `n` samples (decided without the samples)."""
    if not 0 <= ratio < 1:
        raise DataError(f"split_dataset_ratio must be in [0, 1), got {ratio}")
    # A requested split needs a sample on both sides, however small the ratio or the data.
    held_out = min(max(round(ratio * n), 1), n - 1) if ratio > 0 and n >= 2 else 0
    if not held_out:
        return set()
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return set(order[:held_out])
