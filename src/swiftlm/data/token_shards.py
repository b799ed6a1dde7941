"""Pre-training corpora tokenized once, in parallel worker processes, into sharded flat token
files read memory-mapped (Megatron-style indexed binaries: one uint16/uint32 `.bin` per
shard, the index in `meta.json`).

An entry is keyed like the Arrow cache (the files' content, the tokenizer, the options;
data.corpus_key remembers each file's digest by its size and time, so a resume re-reads
none of the corpus) but not by --max_length: the shards hold the token stream, and
`TokenChunks` cuts it into --max_length chunks when it is read, so another --max_length
reuses the same entry. Chunk i is tokens [i*L, (i+1)*L) of the stream of every document
followed by EOS, in file order: exactly the chunks of `encode_pretraining`, a last chunk of
one token dropped. Reading a chunk touches only its own pages, so a resumed run never reads
the data it already trained on.

Entries are written into a private folder and renamed into place: an interrupted build
leaves no entry behind.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from swiftlm.data.cache import data_cache_root
from swiftlm.data.corpus_key import corpus_key
from swiftlm.data.loading import BadRow, DataValidationError, LoadReport
from swiftlm.data.sources import BUILTIN_DATASETS, parse_dataset_spec
from swiftlm.data.token_pieces import (
    PIECE_BYTES,
    Piece,
    backend_encoder,
    file_pieces,
    start_worker,
    tokenize_piece,
    tokenize_piece_in_worker,
)
from swiftlm.errors import DataError

FORMAT = "swiftlm-token-shards"
FORMAT_VERSION = 1
SHARDED_SUFFIXES = (".jsonl", ".txt")


def shard_blocker(specs: list[str]) -> str | None:
    """Why these --dataset specs cannot be read into token shards (None: they can): every
    spec must be a local .jsonl/.txt file, or a folder of only such files, without `#N`."""
    for spec in specs:
        path, count = parse_dataset_spec(spec)
        local = Path(os.path.expanduser(path))
        if count is not None:
            return f"{spec}: `#N` sampling"
        if path in BUILTIN_DATASETS or not local.exists():
            return f"{spec}: not a local file"
        files = _data_files(local) if local.is_dir() else [local]
        odd = [f.name for f in files if not f.name.lower().endswith(SHARDED_SUFFIXES)]
        if odd or not files:
            return f"{spec}: holds {odd[0] if odd else 'no data files'} (not .jsonl/.txt)"
    return None


def _data_files(folder: Path) -> list[Path]:
    """A folder's data files in the generic loader's order (sorted paths, hidden entries and
    dataset cards passed over: see sources._read_directory)."""
    from swiftlm.data.sources import _folder_files

    return sorted(_folder_files(folder), key=lambda file: file.relative_to(folder).parts)


def spec_files(spec: str) -> list[tuple[Path, str]]:
    """(file, source name in data errors) of a spec, in the generic loader's order."""
    path, _ = parse_dataset_spec(spec)
    local = Path(os.path.expanduser(path))
    if not local.is_dir():
        return [(local, path)]
    files = _data_files(local)
    return [(file, os.path.join(path, *file.relative_to(local).parts)) for file in files]


def plan_pieces(specs: list[str], piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    """Every file of every spec, in the generic loader's order, cut into pieces."""
    return [
        piece
        for spec in specs
        for file, source in spec_files(spec)
        for piece in file_pieces(file, source, piece_bytes)
    ]


def token_dtype(tokenizer) -> str:
    """uint16 when every id fits (vocabularies up to 65,536 tokens), else uint32."""
    return "uint16" if max(len(tokenizer), tokenizer.eos_token_id + 1) <= 1 << 16 else "uint32"


def _eos(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token to separate documents for pre-training")
    return tokenizer.eos_token_id


def _tokenize_pieces(pieces, tokenizer, folder: Path, workers: int, dtype: str) -> list[dict]:
    """Each piece's PieceReport, its tokens written to folder/shard-NNNNN.bin. A fast
    tokenizer runs in `workers` spawned processes (1: in this one); a slow one here."""
    eos = _eos(tokenizer)
    paths = [str(folder / f"shard-{i:05d}.bin") for i in range(len(pieces))]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or workers <= 1 or len(pieces) == 1:
        if backend is not None:
            encode = backend_encoder(backend.to_str())
        else:  # a slow (Python) tokenizer: as encode_pretraining calls it
            encode = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
        return [
            tokenize_piece(p, out, encode, eos, dtype) for p, out in zip(pieces, paths, strict=True)
        ]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # Spawned, not forked: a fork could copy locks held by torch's or the tokenizer's threads.
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, context, start_worker, (backend.to_str(),))
    n = len(pieces)
    try:
        reports = list(pool.map(tokenize_piece_in_worker, pieces, paths, [eos] * n, [dtype] * n))
    except BaseException:  # Ctrl-C, a bad file: drop the pieces not started, do not wait
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return reports


def _settle_bad_rows(pieces: list[Piece], reports: list[dict], skip_bad_rows: bool) -> LoadReport:
    """Bad rows named by file:line (a piece's lines counted after the pieces before it in the
    same file); raise DataValidationError unless skip_bad_rows."""
    load = LoadReport()
    first_line: Counter[str] = Counter()
    bad_rows, bad_count = [], 0
    for piece, report in zip(pieces, reports, strict=True):
        offset = first_line[piece.source]
        first_line[piece.source] += report["lines"]
        load.rows_read[piece.source] += report["documents"] + report["bad_count"]
        load.unused_columns.update(report["unused"])
        bad_count += report["bad_count"]
        for line, reason, kind in report["bad_rows"]:
            bad_rows.append(BadRow(piece.source, offset + line, reason, kind))
            load.skipped[kind] += 1
    if bad_count and not skip_bad_rows:
        raise DataValidationError(bad_rows, load.total_rows)
    return load


def build_shards(
    specs: list[str],
    tokenizer,
    folder: Path,
    *,
    workers: int = 1,
    skip_bad_rows: bool = False,
    piece_bytes: int = PIECE_BYTES,
) -> dict:
    """Tokenize the corpus into a new entry at `folder` (replacing any); return its meta."""
    started = time.perf_counter()
    pieces = plan_pieces(specs, piece_bytes)
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        dtype = token_dtype(tokenizer)
        reports = _tokenize_pieces(pieces, tokenizer, partial, workers, dtype)
        load = _settle_bad_rows(pieces, reports, skip_bad_rows)
        meta = _meta(pieces, reports, load, dtype, _eos(tokenizer), workers, started)
        (partial / "meta.json").write_text(json.dumps(meta, indent=1))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    try:
        partial.rename(folder)
    except OSError:  # another process finished the same entry first: keep theirs
        shutil.rmtree(partial, ignore_errors=True)
    return json.loads((folder / "meta.json").read_text())


def _meta(pieces, reports, load: LoadReport, dtype, eos, workers, started) -> dict:
    documents = sum(r["documents"] for r in reports)
    if not documents:
        raise DataError(f"no valid samples in dataset(s) {', '.join(sorted(load.rows_read))}")
    seconds = time.perf_counter() - started
    size = sum(p.end - p.start for p in pieces)
    tokens = sum(r["tokens"] for r in reports)
    lines = [load.summary()] if load.skipped else []
    lines += load.notices("pt")
    lines.append(
        f"tokenized {documents:,} documents ({size / 1e6:,.1f} MB) into {tokens:,} tokens in "
        f"{seconds:.1f} s with {workers} worker{'s' if workers > 1 else ''}: "
        f"{size / 1e6 / seconds:,.1f} MB/s, {tokens / seconds:,.0f} tokens/s"
    )
    shards = [
        {"file": f"shard-{i:05d}.bin", "tokens": r["tokens"], "source": p.source, "start": p.start}
        for i, (p, r) in enumerate(zip(pieces, reports, strict=True))
    ]
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "dtype": dtype,
        "eos": eos,
        "documents": documents,
        "tokens": tokens,
        "bytes": size,
        "shards": shards,
        "log": lines,
        "encode_seconds": seconds,
    }


class TokenChunks(Sequence):
    """The --max_length chunks of a token-shard entry: `chunks[i]` is {"input_ids",
    "labels"} (the same ids: pre-training has loss on every token), read from the
    memory-mapped shards: lists of ints, as the in-memory encoding gives them."""

    # The loop may collate the next step's batches in a background thread (data.prefetch).
    prefetch = True

    def __init__(self, folder: Path, meta: dict, max_length: int):
        self.folder, self.max_length = folder, max_length
        shards = [s for s in meta["shards"] if s["tokens"]]
        self._arrays = [np.memmap(folder / s["file"], meta["dtype"], "r") for s in shards]
        self._starts = np.cumsum([0, *(s["tokens"] for s in shards)])
        self.total_tokens = int(self._starts[-1])
        chunks = -(-self.total_tokens // max_length)
        # The last chunk of one token has nothing to predict: dropped, as encode_pretraining.
        self.dropped = int(chunks and self.total_tokens - (chunks - 1) * max_length == 1)
        self._len = chunks - self.dropped

    def __len__(self) -> int:
        return self._len

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream."""
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        parts = []
        while start < stop:
            offset = start - int(self._starts[shard])
            part = self._arrays[shard][offset : offset + stop - start]
            parts.append(part)
            start += len(part)
            shard += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"chunk {index} of {len(self)}")
        start = (index % len(self)) * self.max_length
        ids = self.tokens(start, min(start + self.max_length, self.total_tokens)).tolist()
        return {"input_ids": ids, "labels": list(ids)}

    @property
    def label_counts(self) -> tuple[int, int, int]:
        """(label tokens, tokens, chunks) for the data-health summary (train.prepare), known
        without reading a chunk: every token of every chunk is a label."""
        tokens = self.total_tokens - self.dropped
        return tokens, tokens, len(self)

    @property
    def lengths(self) -> list[int]:
        """The token length of every chunk, without reading any."""
        if not self._len:
            return []
        last = self.total_tokens - (self._len - 1) * self.max_length
        return [self.max_length] * (self._len - 1) + [min(last, self.max_length)]


def shard_cache_folder(specs: list[str], tokenizer, skip_bad_rows: bool) -> Path:
    """The entry of these data files and tokenizer (not of --max_length: see module doc)."""
    options = {"method": "pt", "layout": FORMAT, "shards": FORMAT_VERSION}
    options["skip_bad_rows"] = skip_bad_rows
    files = {spec: [file for file, _ in spec_files(spec)] for spec in specs}
    return data_cache_root() / f"shards-{corpus_key(files, options, tokenizer)}"


def load_or_build_shards(
    specs: list[str],
    tokenizer,
    max_length: int,
    log: Callable[[str], None],
    *,
    workers: int = 1,
    skip_bad_rows: bool = False,
    rebuild: bool = False,
    build: bool = True,
    piece_bytes: int = PIECE_BYTES,
) -> TokenChunks:
    """The chunks of the cached entry for `specs`, built first when missing (or `rebuild`).
    `build` False (ranks other than 0) only reads the entry that rank 0 made."""
    started = time.perf_counter()
    folder = shard_cache_folder(specs, tokenizer, skip_bad_rows)
    meta = _read_meta(folder, log) if not rebuild or not build else None
    if meta is None:
        if not build:
            raise DataError(f"token shards missing at {folder} (rank 0 did not write them)")
        options = dict(workers=workers, skip_bad_rows=skip_bad_rows, piece_bytes=piece_bytes)
        meta = build_shards(specs, tokenizer, folder, **options)
        for line in meta["log"]:
            log(line)
        log(f"token shards cached at {folder}")
    else:
        for line in meta["log"][:-1]:  # the throughput line is the first run's
            log(line)
        log(
            f"token shards loaded from cache in {time.perf_counter() - started:.2f} s "
            f"(tokenizing took {meta['encode_seconds']:.1f} s): {folder}"
        )
    return TokenChunks(folder, meta, max_length)


def _read_meta(folder: Path, log) -> dict | None:
    """An entry's index, None when there is none or it is unusable (then removed)."""
    path = folder / "meta.json"
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
        if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"format {meta.get('format')} {meta.get('version')}")
        itemsize = np.dtype(meta["dtype"]).itemsize
        for shard in meta["shards"]:
            size = (folder / shard["file"]).stat().st_size
            if size != shard["tokens"] * itemsize:
                raise ValueError(f"{shard['file']} holds {size} bytes")
    except (OSError, ValueError, KeyError) as exc:
        log(f"token-shard cache entry {folder} is unusable ({exc}); re-tokenizing")
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return meta
