"""`swiftlm pt --streaming true`: a corpus read and tokenized while training, never written
to a cache, and resumed from a saved byte offset instead of re-reading what was consumed.

The stream is the one that `encode_pretraining` cuts: every document's token ids followed
by EOS, in file order (the files of each --dataset in the generic loader's order), cut into
--max_length chunks. There is no shuffling: streaming trains in file order (as `datasets`'
streaming mode does without a shuffle buffer), unless --shuffle_buffer_size K shuffles it in
consecutive windows of K chunks (a permutation seeded by --data_seed and the window's index:
a resume re-reads at most the K chunks of its window). When the corpus ends the stream starts over
from its first file (another pass), the chunk in progress carrying on across the seam, so
--max_steps may ask for more chunks than one pass holds.

A chunk's start is a `StreamPosition`: the file, the byte offset and line number of the
document the chunk starts in, and how many tokens of that document came before it. A
checkpoint keeps the position of the next step's first chunk; a resumed run seeks there and
re-reads (and re-tokenizes) only that one document.

A background thread reads, tokenizes (the fast tokenizer's Rust backend, in batches that
release the GIL) and cuts chunks into a bounded queue, so memory holds a few batches of
documents and chunks whatever the corpus size (and one whole .txt file, which is one
document).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from swiftlm.data.formats import RowError, text_sample
from swiftlm.data.prefetch import put_unless_stopped
from swiftlm.data.sources import decode_text_file
from swiftlm.data.token_pieces import backend_encoder, row_text
from swiftlm.errors import DataError

QUEUED_CHUNKS = 64  # chunks cut ahead of the loop
BATCH_DOCUMENTS = 256  # documents tokenized in one backend call
BATCH_BYTES = 1 << 20  # ... or fewer, when they hold this much text
REPORTED_BAD_ROWS = 5  # skipped rows named in the log; more are only counted


@dataclass(frozen=True)
class StreamPosition:
    """Where a chunk starts: token `token` of the document on line `line` (at byte `offset`)
    of the stream's file `file`, in pass `passes` over the corpus (0: the first)."""

    file: int = 0
    offset: int = 0
    line: int = 1
    token: int = 0
    passes: int = 0

    def as_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, saved: dict) -> StreamPosition:
        fields = ("file", "offset", "line", "token", "passes")
        return cls(*(int(saved.get(name, 0)) for name in fields))


class ConstantLengths(Sequence):
    """`count` chunk lengths that are all `length` (a stream's chunks are all full), without
    a list of them: the batch plan and the data-health summary read it as an array."""

    def __init__(self, count: int, length: int):
        self.count, self.length = count, length

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.length] * len(range(*index.indices(self.count)))
        if not -self.count <= index < self.count:
            raise IndexError(index)
        return self.length

    def __iter__(self):
        return itertools.repeat(self.length, self.count)

    def __array__(self, dtype=None, copy=None):
        return np.full(self.count, self.length, dtype=dtype or np.int64)


class DocumentReader:
    """The documents of `files` ([(path, name in errors)]) from a position on, forever (pass
    after pass); counts the bytes it reads (`bytes_read`) and where it first seeked."""

    def __init__(self, files: list[tuple[Path, str]], skip_bad_rows: bool, log):
        self.files, self.skip_bad_rows, self.log = files, skip_bad_rows, log
        self.bytes_read = 0
        self.first_seek: tuple[int, int] | None = None  # (file index, byte offset)
        self.skipped = 0

    def documents(
        self, start: StreamPosition
    ) -> Iterator[tuple[StreamPosition, str, StreamPosition]]:
        """(the document's position, its text, the position of the line after it)."""
        position = replace(start, token=0)
        whole_pass = position.file == 0 and position.offset == 0  # not a resumed part of one
        found = False
        while True:
            for item in self._file_documents(position):
                found = True
                yield item
            if position.file + 1 < len(self.files):
                position = StreamPosition(position.file + 1, passes=position.passes)
                continue
            if whole_pass and not found:
                names = ", ".join(source for _, source in self.files)
                raise DataError(f"no valid documents to pre-train on in {names}")
            position, whole_pass, found = StreamPosition(passes=position.passes + 1), True, False
            self.log(
                f"streaming: the data ended; pass {position.passes + 1} over it starts again "
                f"at {self.files[0][1]} (--max_steps asks for more chunks than one pass holds)"
            )

    def _file_documents(self, at: StreamPosition):
        path, source = self.files[at.file]
        if self.first_seek is None:
            self.first_seek = (at.file, at.offset)
        with open(path, "rb") as f:
            f.seek(at.offset)
            if path.suffix.lower() == ".txt":  # one document: the whole file
                if at.offset == 0:  # (a position past it: consumed)
                    data = f.read()
                    text = self._whole_text(data, at, source)
                    if text is not None:
                        yield at, text, replace(at, offset=len(data), line=2)
                return
            offset, line = at.offset, at.line
            for raw in iter(f.readline, b""):
                self.bytes_read += len(raw)
                here = replace(at, offset=offset, line=line, token=0)
                offset, line = offset + len(raw), line + 1
                text = self._line_text(raw, here, source)
                if text is not None:
                    yield here, text, replace(here, offset=offset, line=line)

    def _whole_text(self, data: bytes, at: StreamPosition, source: str) -> str | None:
        """A .txt file's text, None when (with --skip_bad_rows) it has none."""
        self.bytes_read += len(data)
        text = decode_text_file(data, source)
        try:
            return text_sample({"text": text})["text"]
        except RowError as error:
            return self._bad_row(error, f"{source}:1")

    def _line_text(self, raw: bytes, here: StreamPosition, source: str) -> str | None:
        """A JSON line's text, None for a blank line or (with --skip_bad_rows) a bad one."""
        body = raw[:-1] if raw.endswith(b"\n") else raw
        try:
            row = row_text(body, file_start=here.offset == 0)
        except RowError as error:
            return self._bad_row(error, f"{source}:{here.line}")
        return None if row is None else row[0]

    def _bad_row(self, error: RowError, where: str) -> None:
        """Raise a DataError naming the row, or (--skip_bad_rows) count it and go on."""
        if not self.skip_bad_rows:
            raise DataError(
                f"{where}: {error}; fix or remove the row, or pass --skip_bad_rows true to "
                "skip (and count) bad rows"
            )
        self.skipped += 1
        if self.skipped <= REPORTED_BAD_ROWS:
            self.log(f"streaming: skipped {where} ({error})")
        elif self.skipped % 1000 == 0:
            self.log(f"streaming: {self.skipped:,} bad rows skipped so far")
        return None


def _encoder(tokenizer):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend_encoder(backend.to_str())
    return lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]


def _batches(documents: Iterator) -> Iterator[list]:
    """Documents grouped for one tokenizer call (by count and by text size)."""
    batch, size = [], 0
    for document in documents:
        batch.append(document)
        size += len(document[1])
        if len(batch) == BATCH_DOCUMENTS or size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0


class ChunkCutter:
    """The stream's --max_length chunks from `start` on, with where each starts and ends."""

    def __init__(self, reader: DocumentReader, tokenizer, max_length: int):
        self.reader, self.max_length = reader, max_length
        self.encode, self.eos = _encoder(tokenizer), tokenizer.eos_token_id
        self._after_last = StreamPosition()
        if self.eos is None:
            raise DataError("the tokenizer has no EOS token to separate documents for pre-training")

    def chunks(self, start: StreamPosition) -> Iterator[tuple[np.ndarray, StreamPosition]]:
        """(chunk ids, the position of the chunk after it)."""
        pending: deque = deque()  # [position, ids with EOS, tokens consumed, position after]
        buffered, skip = 0, start.token
        for batch in _batches(self.reader.documents(start)):
            encoded = self.encode([text for _, text, _ in batch])
            for (position, _, after), ids in zip(batch, encoded, strict=True):
                tokens = np.asarray([*ids, self.eos], dtype=np.int64)
                pending.append([position, tokens, skip, after])
                buffered += len(tokens) - skip
                skip = 0  # only the resumed document starts part-way
            while buffered >= self.max_length:
                yield self._cut(pending), self._next_start(pending)
                buffered -= self.max_length

    def _cut(self, pending: deque) -> np.ndarray:
        parts, wanted = [], self.max_length
        while wanted:
            entry = pending[0]
            part = entry[1][entry[2] : entry[2] + wanted]
            parts.append(part)
            entry[2] += len(part)
            wanted -= len(part)
            if entry[2] == len(entry[1]):
                self._after_last = entry[3]
                pending.popleft()
        return np.concatenate(parts)

    def _next_start(self, pending: deque) -> StreamPosition:
        """The first unconsumed token: in the oldest pending document, or (none pending: every
        document read so far is consumed) the line after the last one."""
        if pending:
            return replace(pending[0][0], token=pending[0][2])
        return self._after_last


class StreamChunks(Sequence):
    """A stream's chunks as the loop reads them: `chunks[i]` is {"input_ids", "labels"}, and
    i must be the next index (the batch plan of a streaming run is sequential). `len` is the
    chunks the run trains on (--max_steps x the global batch), the number a checkpoint's
    `num_train_samples` records."""

    prefetch = True  # the loop may collate the next steps in its prefetch thread

    def __init__(
        self, files, tokenizer, max_length: int, length: int, *, skip_bad_rows=False,
        log=print, window: int = 4096, shuffle_buffer_size: int = 0, seed: int = 42,
    ):  # fmt: skip
        self.shuffle_buffer_size, self.seed = shuffle_buffer_size, seed
        self.reader = DocumentReader(files, skip_bad_rows, log)
        self.cutter = ChunkCutter(self.reader, tokenizer, max_length)
        self.max_length, self._len, self.window, self.log = max_length, length, window, log
        self._next, self._starts = 0, {0: StreamPosition()}
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._len

    @property
    def lengths(self) -> ConstantLengths:
        return ConstantLengths(self._len, self.max_length)

    @property
    def label_counts(self) -> tuple[int, int, int]:
        """(label tokens, tokens, chunks): every token of every (full) chunk is a label."""
        tokens = self._len * self.max_length
        return tokens, tokens, self._len

    def seek(self, index: int, position: StreamPosition) -> None:
        """Start reading at chunk `index`, which starts at `position` (a resume; shuffled, the
        position of the window `index` is in): only before the first chunk is read."""
        if self._queue is not None:
            raise RuntimeError("internal error: the stream was sought after reading began")
        self._next, self._starts = index, {index: position}

    def position_at(self, index: int) -> StreamPosition:
        """Where reading resumes to serve chunk `index` next (for a checkpoint): where it
        starts, or, shuffled, where its window starts; for a chunk read recently, or the next."""
        with self._lock:
            if index not in self._starts:
                raise RuntimeError(
                    f"internal error: the stream position of chunk {index} is no longer kept "
                    f"(chunks {min(self._starts)}-{max(self._starts)} are)"
                )
            return self._starts[index]

    def __getitem__(self, index):
        if index != self._next:
            raise RuntimeError(
                f"internal error: streaming data read out of order (chunk {index} asked, chunk "
                f"{self._next} is next): a streaming run's batch plan must be sequential"
            )
        if self._queue is None:
            self._start_thread()
        ids, after = self._take()
        with self._lock:
            self._next = index + 1
            self._starts[index + 1] = after
            self._starts.pop(index + 1 - self.window, None)
        if index + 1 == self._len:  # the run reads no further: stop reading ahead
            self.close()
        ids = ids.tolist()
        return {"input_ids": ids, "labels": list(ids)}

    def _take(self):
        while True:
            try:
                kind, value = self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("internal error: the streaming reader stopped") from None
                continue
            if kind == "error":
                raise value
            return value

    def _start_thread(self) -> None:
        self._queue = queue.Queue(maxsize=QUEUED_CHUNKS)
        start = self._starts[self._next]
        if self._next:
            path = self.reader.files[start.file][1]
            self.log(
                f"streaming: resuming chunk {self._next} at {path}:{start.line} (byte "
                f"{start.offset}), token {start.token} of its document, pass {start.passes + 1}"
            )
        self._thread = threading.Thread(
            target=self._fill, args=(start, self._next), name="swiftlm-stream", daemon=True
        )
        self._thread.start()

    def _fill(self, start: StreamPosition, first: int) -> None:
        try:
            chunks = self.cutter.chunks(start)
            if self.shuffle_buffer_size:
                chunks = self._shuffled(chunks, start, first)
            for item in chunks:
                if not self._put(("chunk", item)):
                    return
        except BaseException as exc:  # noqa: BLE001 - raised by the reading __getitem__
            self._put(("error", exc))

    def _shuffled(self, chunks: Iterator, start: StreamPosition, first: int) -> Iterator:
        """(chunk, where reading resumes for the next one) in windows of K chunks, each
        permuted by (seed, window index); from chunk `first`, its window read from `start`."""
        size = self.shuffle_buffer_size
        window, skip = divmod(first, size)
        while True:
            held = list(itertools.islice(chunks, size))
            order = np.random.default_rng([self.seed, window]).permutation(size)
            after = held[-1][1]  # the next window starts where this one's last chunk ended
            for k in range(skip, size):
                yield held[order[k]][0], (start if k + 1 < size else after)
            window, skip, start = window + 1, 0, after

    def _put(self, entry) -> bool:
        return put_unless_stopped(self._queue, entry, self._stop)

    def close(self) -> None:
        self._stop.set()
