"""Encode the splits of a large dataset chunk by chunk into the Arrow cache entry, with memory
bounded by a few chunks whatever the dataset's size.

The rows of each split are chosen from counts first (data.selection: the same samples, in the
same order, as the in-memory path), then read again in order, cut into chunks of
ROWS_PER_CHUNK samples, encoded (in the main process, or in --dataset_num_proc spawned worker
processes, at most two chunks per worker in flight) and appended to the split's Arrow file
as one record batch per chunk, in order.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from swiftlm.data.cache import LENGTH_COLUMN, CachedLine, SplitWriter, record_batch
from swiftlm.data.encode import IGNORE_INDEX
from swiftlm.data.loading import LoadReport
from swiftlm.data.selection import Selection, chunks, iter_samples, select, split_selection

# Samples per chunk: large enough that a worker's round trip is cheap next to encoding it,
# small enough that the chunks in flight stay a few MB.
ROWS_PER_CHUNK = 2048
CHUNKS_IN_FLIGHT_PER_WORKER = 2


@dataclass(frozen=True)
class DataOptions:
    """What chooses the samples of each split (the data flags of load_splits)."""

    dataset: list[str]
    val_dataset: list[str]
    skip_bad_rows: bool
    seed: int
    split_ratio: float


def select_splits(
    options: DataOptions, to_sample: Callable[[dict], dict], method: str, log
) -> dict[str, Selection]:
    """{"train": ..., "val": ...}: the samples train.prepare.load_splits would load, as
    selections, with the same lines logged (skipped rows, unused columns)."""
    chosen = {}
    for name, specs in (("train", options.dataset), ("val", options.val_dataset)):
        if not specs:
            continue
        prefix = "--val_dataset: " if name == "val" else ""
        report = LoadReport()
        chosen[name] = select(
            specs, to_sample, report, skip_bad_rows=options.skip_bad_rows, seed=options.seed
        )
        if report.skipped:
            log(prefix + report.summary())
        for line in report.notices(method):
            log(prefix + line)
    if "val" not in chosen:
        chosen["train"], chosen["val"] = split_selection(
            chosen["train"], options.split_ratio, options.seed
        )
    return chosen


@dataclass
class ChunkJob:
    """Encodes one chunk into a record batch: what a worker process is given once. Pickles
    (the encoder's tokenizer with it); `length` must be a module-level function."""

    encoder: object  # e.g. data.encode.ChatChunkEncoder
    columns: tuple[str, ...]
    length: Callable[[dict], int]
    label_columns: tuple[list[str], list[str]]  # (label columns, token-id columns)

    def __call__(self, samples: list[dict], split: str) -> ChunkResult:
        report = self.encoder.new_report()
        encoded = self.encoder.encode(samples, report)
        result = ChunkResult(len(samples), report.counts)
        if encoded:
            result.batch = record_batch(encoded, self.columns, self.length, split)
            result.count_labels(*self.label_columns)
        return result


@dataclass
class ChunkResult:
    """One encoded chunk, as a worker sends it back."""

    rows: int  # samples given
    counts: Counter  # the TruncationReport's counts of the chunk
    batch: object = None  # the kept encodings as an Arrow record batch (None: none kept)
    marked: int = 0  # label positions that carry loss
    tokens: int = 0  # tokens of the token-id columns

    def count_labels(self, labels: list[str], ids: list[str]) -> None:
        import pyarrow.compute as pc

        for name in labels:
            flat = pc.list_flatten(self.batch.column(name))
            self.marked += int(pc.sum(pc.not_equal(flat, IGNORE_INDEX)).as_py() or 0)
        for name in ids:
            self.tokens += len(pc.list_flatten(self.batch.column(name)))


@dataclass
class SplitTotals:
    """The sums over a split's chunks."""

    rows: int = 0
    kept: int = 0
    tokens: int = 0  # the stored lengths of the kept samples
    marked: int = 0
    id_tokens: int = 0
    counts: Counter = field(default_factory=Counter)

    def add(self, result: ChunkResult) -> None:
        self.rows += result.rows
        self.counts.update(result.counts)
        self.marked += result.marked
        self.id_tokens += result.tokens
        if result.batch is not None:
            import pyarrow.compute as pc

            self.kept += result.batch.num_rows
            self.tokens += int(pc.sum(result.batch.column(LENGTH_COLUMN)).as_py())


def encode_splits(
    selections: dict[str, Selection],
    folder: Path,
    to_sample: Callable[[dict], dict],
    job: ChunkJob,
    workers: int = 1,
    chunk_rows: int | None = None,
    started: float | None = None,
) -> tuple[list[str], list[str], dict]:
    """Write `<split>.arrow` for each selection into `folder`; (split names, log lines,
    stats) as data.cache.load_or_stream_encode wants them. The stats hold each split's
    truncation counts, and its label counts as (label tokens, tokens, samples). The
    throughput line counts from `started` (time.perf_counter(); default: now), so a caller
    that selected the rows first can include that pass."""
    chunk_rows = chunk_rows or ROWS_PER_CHUNK
    lines, stats = [], {"truncation": {}, "labels": {}}
    started = time.perf_counter() if started is None else started
    rows = tokens = 0
    with _chunk_runner(job, workers) as run:
        for name, selection in selections.items():
            totals = _encode_split(name, selection, folder, to_sample, job, run, chunk_rows)
            report = job.encoder.new_report()
            report.counts.update(totals.counts)
            if totals.rows and not totals.kept:
                raise job.encoder.nothing_left(totals.rows, report)
            lines += [report.summary()] if report.summary() else []
            stats["truncation"][name] = report.as_dict() if totals.rows else {}
            if all(job.label_columns):
                stats["labels"][name] = [totals.marked, totals.id_tokens, totals.kept]
            rows, tokens = rows + totals.rows, tokens + totals.tokens
    lines.append(throughput_line(rows, tokens, time.perf_counter() - started, workers))
    return list(selections), lines, stats


def throughput_line(rows: int, tokens: int, seconds: float, workers: int) -> CachedLine:
    """The encoding's speed, e.g. "encoded 1,000 samples (90,000 tokens kept) in 2.0 s with
    1 process: 500 rows/s, 45,000 tokens/s" (a cached run repeats it, saying so)."""
    seconds = max(seconds, 1e-9)
    where = f"{workers} processes" if workers > 1 else "1 process"
    line = (
        f"encoded {rows:,} samples ({tokens:,} tokens kept) in {seconds:.1f} s with {where}: "
        f"{rows / seconds:,.0f} rows/s, {tokens / seconds:,.0f} tokens/s"
    )
    return CachedLine(line, f"{line} (when the cache entry was made)")


def _encode_split(name, selection, folder, to_sample, job, run, chunk_rows) -> SplitTotals:
    writer = SplitWriter(folder / f"{name}.arrow", job.columns, job.length, name)
    totals = SplitTotals()
    try:
        for result in run(chunks(iter_samples(selection, to_sample), chunk_rows), name):
            totals.add(result)
            if result.batch is not None:
                writer.write(result.batch)
    finally:
        writer.close()
    return totals


class _chunk_runner:
    """A context giving run(chunks, split) -> the ChunkResults in order: in this process, or
    in `workers` spawned processes (fork could copy locks held by the tokenizer's threads)."""

    def __init__(self, job: ChunkJob, workers: int):
        self.job, self.workers, self.pool = job, workers, None

    def __enter__(self):
        if self.workers > 1:
            from concurrent.futures import ProcessPoolExecutor

            context = multiprocessing.get_context("spawn")
            self.pool = ProcessPoolExecutor(self.workers, context, _start_worker, (self.job,))
        return self.run

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def run(self, pieces: Iterator[list[dict]], split: str) -> Iterator[ChunkResult]:
        if self.pool is None:
            for piece in pieces:
                yield self.job(piece, split)
            return
        pending = deque()
        for piece in pieces:
            pending.append(self.pool.submit(_run_in_worker, piece, split))
            if len(pending) >= self.workers * CHUNKS_IN_FLIGHT_PER_WORKER:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


_WORKER_JOB: ChunkJob | None = None  # the job of a worker process (set by _start_worker)


def _start_worker(job: ChunkJob) -> None:
    global _WORKER_JOB
    _WORKER_JOB = job


def _run_in_worker(samples: list[dict], split: str) -> ChunkResult:
    return _WORKER_JOB(samples, split)
