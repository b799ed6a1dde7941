"""The worker side of token shards: a pre-training corpus cut into byte ranges ("pieces"),
each read, validated and tokenized into one flat token file.

A JSON Lines file is cut at line boundaries into pieces of about PIECE_BYTES; a .txt file is
one document (as `swiftlm pt` reads it everywhere) and one piece. A piece's tokens are every
valid document's token ids followed by the EOS id, in file order: concatenated in piece
order they are exactly the stream that `encode_pretraining` cuts into chunks.

Workers are spawned processes that hold only the tokenizer's Rust backend (rebuilt from its
JSON, no pickle, no transformers import) and one piece at a time, so memory stays flat
whatever the corpus size.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

from swiftlm.data.columns import given
from swiftlm.data.formats import RowError, columns_read, text_sample
from swiftlm.data.sources import NOT_AN_OBJECT, decode_text_file

PIECE_BYTES = 16 << 20  # text per piece: many pieces per worker even out their speeds
DOCUMENTS_PER_BATCH = 1000  # documents tokenized in one backend call
KEPT_BAD_ROWS = 1000  # per piece; more are only counted


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of one data file; `source` names the file as data errors do."""

    path: str
    source: str
    start: int
    end: int

    @property
    def whole_text(self) -> bool:
        return self.path.lower().endswith(".txt")


def file_pieces(path: Path, source: str, piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    """A .txt file whole; a JSON Lines file cut after the first line break past each
    `piece_bytes` boundary (a line is never split)."""
    size = path.stat().st_size
    if path.suffix.lower() == ".txt" or size == 0:
        return [Piece(str(path), source, 0, size)]
    pieces, start = [], 0
    with path.open("rb") as f:
        while start < size:
            f.seek(min(start + piece_bytes, size))
            f.readline()  # to the end of the line the boundary fell in
            end = max(f.tell(), min(start + piece_bytes, size))
            pieces.append(Piece(str(path), source, start, end))
            start = end
    return pieces


# One tokenizer per worker process, set by start_worker.
_WORKER: dict = {}


def backend_encoder(backend_json: str):
    """`encode(texts) -> list of id lists` of a fast tokenizer's serialized backend, with no
    truncation or padding: what the transformers tokenizer gives with add_special_tokens=False."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(backend_json)
    tokenizer.no_truncation()
    tokenizer.no_padding()

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]

    return encode


def start_worker(backend_json: str) -> None:
    _WORKER["encode"] = backend_encoder(backend_json)


def tokenize_piece_in_worker(piece: Piece, out_path: str, eos: int, dtype: str) -> dict:
    return tokenize_piece(piece, out_path, _WORKER["encode"], eos, dtype)


def row_text(raw: bytes, file_start: bool) -> tuple[str, dict] | None:
    """(the pre-training text, the parsed row) of one JSON line, None for a blank line;
    raises RowError as the generic loader words it (invalid JSON, not an object, no text ...).
    `file_start`: the file's first line, which may begin with a byte-order mark."""
    try:
        line = raw.decode("utf-8-sig" if file_start else "utf-8")
    except UnicodeDecodeError as e:
        raise RowError("invalid JSON", f"invalid JSON: not UTF-8 text ({e.reason})") from None
    if not line.strip():
        return None
    try:
        record = json.loads(line.rstrip("\r"))
    except json.JSONDecodeError as e:
        raise RowError("invalid JSON", f"invalid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(record, dict):
        raise RowError("not an object", NOT_AN_OBJECT)
    return text_sample(record)["text"], record


def _unused(record: dict) -> list[str]:
    read = columns_read(record, {"text": ""}) or {"text"}
    return [column for column, value in record.items() if column not in read and given(value)]


class PieceReport:
    """What one piece held: documents, lines, bad rows (line numbers within the piece)."""

    def __init__(self):
        self.documents = self.lines = self.tokens = self.bad_count = 0
        self.bad_rows: list[tuple[int, str, str]] = []  # (line in piece, reason, kind)
        self.unused: Counter[str] = Counter()

    def bad(self, line: int, error: RowError) -> None:
        self.bad_count += 1
        if len(self.bad_rows) < KEPT_BAD_ROWS:
            self.bad_rows.append((line, str(error), error.kind))

    def as_dict(self) -> dict:
        return {
            "documents": self.documents,
            "lines": self.lines,
            "tokens": self.tokens,
            "bad_count": self.bad_count,
            "bad_rows": self.bad_rows,
            "unused": dict(self.unused),
        }


def _piece_texts(piece: Piece, report: PieceReport):
    """Yield the valid documents of a piece in order; bad rows go to `report`."""
    with open(piece.path, "rb") as f:
        f.seek(piece.start)
        data = f.read(piece.end - piece.start)
    if piece.whole_text:
        report.lines = 1
        text = decode_text_file(data, piece.source)
        try:
            yield text_sample({"text": text})["text"]
        except RowError as error:
            report.bad(1, error)
        return
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the piece ends with a line break
    report.lines = len(lines)
    for number, raw in enumerate(lines, start=1):
        try:
            row = row_text(raw, file_start=piece.start == 0 and number == 1)
        except RowError as error:
            report.bad(number, error)
            continue
        if row is None:
            continue
        text, record = row
        report.unused.update(_unused(record))
        yield text


def tokenize_piece(piece: Piece, out_path: str, encode, eos: int, dtype: str) -> dict:
    """Write the piece's tokens (each document's ids, then `eos`) to `out_path`; return its
    PieceReport as a dict. `encode(texts)` gives the id lists of a batch of texts."""
    report = PieceReport()
    with open(out_path, "wb") as out:
        batch: list[str] = []
        for text in chain(_piece_texts(piece, report), [None]):
            if text is not None:
                batch.append(text)
            if batch and (text is None or len(batch) == DOCUMENTS_PER_BATCH):
                report.tokens += _write_batch(out, encode(batch), eos, dtype)
                report.documents += len(batch)
                batch = []
        out.flush()
        os.fsync(out.fileno())
    return report.as_dict()


def _write_batch(out, ids: list[list[int]], eos: int, dtype: str) -> int:
    count = sum(len(document) for document in ids) + len(ids)
    flat = chain.from_iterable(chain(document, (eos,)) for document in ids)
    np.fromiter(flat, dtype=dtype, count=count).tofile(out)
    return count
