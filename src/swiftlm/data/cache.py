"""Tokenized datasets cached on disk as Arrow, so a second run skips reading, validating and
tokenizing.

The cache key is a hash of everything the encoded samples depend on: the content of every
local data file (not its name or date), the built-in or hub dataset names, the data and
method options (max_length, truncation, loss scope, system prompt, split, seeds, placeholders
...) and the tokenizer itself (its full serialized vocabulary and chat template). Change any of them and
the run re-tokenizes into a new entry. Hub datasets are keyed by name only: pass
`--load_from_cache_file false` after the hub copy changes.

Entries are written to a temporary folder and renamed into place, so an interrupted run never
leaves a half-written entry behind. Each split is one Arrow IPC file holding the columns the
training method declares plus each sample's token `length`, read memory-mapped with pyarrow:
a row is decoded when a batch needs it, and the `datasets` import is not paid.
"""

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from swiftlm.data.sources import BUILTIN_DATASETS, builtin_dataset_path, parse_dataset_spec

# Bump when the encoding itself or the entry layout changes, so old entries are unused.
# 5: tool calls render through the template's tools; samples without label tokens are dropped.
# 6: an entry keeps the encoding's stats (truncation counts) for the data-health summary.
ENCODING_VERSION = 6
# The stored token length of each sample (batch planning reads it without decoding rows).
LENGTH_COLUMN = "length"


class CachedLine(str):
    """An encoding log line worded differently when its entry is read back: the run that
    encodes prints the line itself, a cached run `cached` (e.g. an image preprocessing
    throughput becomes "skipped": the work was not done again)."""

    cached: str

    def __new__(cls, line: str, cached: str):
        self = super().__new__(cls, line)
        self.cached = cached
        return self


# Stats key: {path: [size, mtime_ns]} of files an encoding read besides the data files.
FILES_READ = "files_read"


def file_fingerprints(paths) -> dict[str, list[int]]:
    """{path: [size, mtime_ns]} of local files (the FILES_READ stats of an encoding)."""
    fingerprints = {}
    for path in sorted(set(paths)):
        stat = os.stat(path)
        fingerprints[path] = [stat.st_size, stat.st_mtime_ns]
    return fingerprints


def first_changed_file(fingerprints: dict[str, list[int]]) -> str | None:
    """The first file whose size or time differs from its fingerprint (or that is gone)."""
    for path, (size, mtime) in fingerprints.items():
        try:
            stat = os.stat(path)
        except OSError:
            return path
        if (stat.st_size, stat.st_mtime_ns) != (size, mtime):
            return path
    return None


def data_cache_root() -> Path:
    """Where tokenized datasets live: $SWIFTLM_DATA_CACHE, else <swiftlm cache>/tokenized."""
    from swiftlm.models.loader import cache_root

    return Path(os.environ.get("SWIFTLM_DATA_CACHE", cache_root() / "tokenized"))


def _hash_file(digest, path: Path) -> None:
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)


def _hash_spec(digest, spec: str) -> None:
    """Local files and folders by content; built-ins by their packaged file; hub ids by name."""
    path, _ = parse_dataset_spec(spec)
    digest.update(spec.encode())
    if path in BUILTIN_DATASETS:
        _hash_file(digest, Path(str(builtin_dataset_path(path))))
        return
    local = Path(path)
    files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
    for file in files:
        if file.is_file():
            digest.update(str(file.relative_to(local) if local.is_dir() else "").encode())
            _hash_file(digest, file)


def _tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocabulary = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab())
    template = getattr(tokenizer, "chat_template", None) or ""
    special = json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
    return hashlib.sha256((vocabulary + template + special).encode()).hexdigest()


def cache_key(specs: list[str], options: dict, tokenizer) -> str:
    """Hex digest identifying one encoded dataset."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"v": ENCODING_VERSION, **options}, sort_keys=True).encode())
    for spec in specs:
        _hash_spec(digest, spec)
    digest.update(_tokenizer_fingerprint(tokenizer).encode())
    return digest.hexdigest()[:32]


class ArrowSamples(Sequence):
    """Encoded samples read from a memory-mapped Arrow file: `samples[i]` is a dict of the
    declared columns, like the in-memory list it replaces, and only the rows asked for are
    decoded."""

    # (label tokens, tokens, samples) when the encoding counted them (see data.stream_encode)
    label_counts: tuple[int, int, int] | None = None

    def __init__(self, table, columns: Sequence[str]):
        self.table = table
        self.columns = tuple(columns)
        self._columns = {name: table.column(name) for name in (*self.columns, LENGTH_COLUMN)}

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, index: int) -> dict:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return {name: self._columns[name][index].as_py() for name in self.columns}

    @property
    def lengths(self) -> list[int]:
        """The stored token length of every sample."""
        return self._columns[LENGTH_COLUMN].to_pylist()


def _narrow_type(value_type, in_list: bool = False):
    """The inferred type with integers inside lists (token ids) as int32: half the bytes."""
    import pyarrow as pa

    if pa.types.is_list(value_type) or pa.types.is_large_list(value_type):
        return pa.list_(_narrow_type(value_type.value_type, in_list=True))
    return pa.int32() if in_list and pa.types.is_int64(value_type) else value_type


def _column_array(values: list, name: str, split: str):
    """One column as an Arrow array of the inferred type, integer lists narrowed to int32."""
    import pyarrow as pa

    try:
        array = pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ValueError(
            f"column {name!r} of split {split!r} mixes value types Arrow cannot store in "
            f"one column ({exc}); every encoded sample must give it the same type"
        ) from None
    narrow = _narrow_type(array.type)
    try:
        return array.cast(narrow) if narrow != array.type else array
    except pa.ArrowInvalid:  # an integer beyond int32: keep int64 rather than wrap around
        return array


def record_batch(samples: list[dict], columns: Sequence[str], length, split: str):
    """Encoded samples as one Arrow record batch of `columns` plus their LENGTH_COLUMN."""
    import pyarrow as pa

    arrays = {}
    for name in columns:
        try:
            values = [sample[name] for sample in samples]
        except KeyError:
            raise ValueError(
                f"an encoded sample of split {split!r} has no column {name!r}; the method "
                f"declares columns {tuple(columns)}"
            ) from None
        arrays[name] = _column_array(values, name, split)
    arrays[LENGTH_COLUMN] = pa.array([length(s) for s in samples], type=pa.int32())
    return pa.record_batch(list(arrays.values()), names=list(arrays))


def _write_arrow(path: Path, samples: list[dict], columns: Sequence[str], length, split: str):
    import pyarrow as pa

    batch = record_batch(samples, columns, length, split)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)


class SplitWriter:
    """One split's Arrow IPC file written a record batch at a time, so the encoded samples
    of a large dataset are never all in memory. The first batch sets the column types; later
    batches are cast to them. A split given no batch is written empty, as _write_arrow does."""

    def __init__(self, path: Path, columns: Sequence[str], length, split: str):
        self.path, self.columns, self.length, self.split = path, tuple(columns), length, split
        self.rows = 0
        self.schema = self._sink = self._writer = None

    def write(self, batch) -> None:
        """Append a record batch (see record_batch)."""
        import pyarrow as pa

        if self._writer is None:
            self._sink = pa.OSFile(str(self.path), "wb")
            self._writer = pa.ipc.new_file(self._sink, batch.schema)
            self.schema = batch.schema
        elif batch.schema != self.schema:
            batch = self._conform(batch)
        self._writer.write_batch(batch)
        self.rows += batch.num_rows

    def _conform(self, batch):
        import pyarrow as pa

        try:
            return batch.cast(self.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
            raise ValueError(
                f"split {self.split!r}: encoded samples change column types between chunks "
                f"({batch.schema} vs {self.schema}: {exc}); every encoded sample must "
                "give a column the same type"
            ) from None

    def close(self) -> None:
        if self._writer is None:
            _write_arrow(self.path, [], self.columns, self.length, self.split)
            return
        self._writer.close()
        self._sink.close()


def _read_arrow(path: Path, columns: Sequence[str]) -> ArrowSamples:
    import pyarrow as pa

    return ArrowSamples(pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all(), columns)


def _write_entry(folder: Path, write: Callable[[Path], None]) -> None:
    """`write(private folder)` writes every split and meta.json there; the folder is then
    renamed into place: a reader sees a whole entry or none, and a failed write leaves nothing
    behind."""
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        write(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    try:
        partial.rename(folder)
    except OSError:  # another process finished the same entry first: keep theirs
        shutil.rmtree(partial, ignore_errors=True)


def _read_entry(folder: Path, columns: tuple[str, ...]) -> tuple[dict, dict]:
    meta = json.loads((folder / "meta.json").read_text())
    if tuple(meta["columns"]) != columns:
        raise ValueError(f"it holds columns {tuple(meta['columns'])}, not {columns}")
    splits = {name: _read_arrow(folder / f"{name}.arrow", columns) for name in meta["splits"]}
    return splits, meta


def load_or_encode(
    folder: Path,
    encode: Callable[[], tuple],
    log: Callable[[str], None],
    *,
    columns: Sequence[str],
    length: Callable[[dict], int],
) -> dict[str, ArrowSamples]:
    """The encoded splits of `load_or_encode_with_stats`, without the stats."""
    return load_or_encode_with_stats(folder, encode, log, columns=columns, length=length)[0]


def load_or_encode_with_stats(
    folder: Path,
    encode: Callable[[], tuple],
    log: Callable[[str], None],
    *,
    columns: Sequence[str],
    length: Callable[[dict], int],
) -> tuple[dict[str, ArrowSamples], dict]:
    """(The encoded splits, the encoding's stats) from `folder`, or from `encode()` (then
    saved to `folder`).

    `encode` returns ({split name: encoded samples}, log lines) or those and a JSON-able
    stats dict (e.g. truncation counts per split). The stats' FILES_READ entry lists files
    the encoding read besides the data files (a row's images), which the key does not hash:
    an entry whose file changed size or time since is encoded again. Lines and stats are stored with the entry
    and given again on a cache hit, so a cached run reports the same truncation and skipped
    rows (a CachedLine in its cached wording). Every encoded sample holds `columns` (other
    keys are not stored); `length(sample)` is stored per sample for batch planning (see
    sample_lengths). Column types are inferred (ints, floats, strings, lists, nested lists
    ...), with integers inside lists as int32. Either way the splits are read back
    memory-mapped, so a first run and a cached run see identical samples.
    """
    columns = tuple(columns)
    hit = _cached_entry(folder, columns, log)
    if hit is not None:
        return hit
    started = time.perf_counter()
    splits, lines, *rest = encode()
    stats = rest[0] if rest else {}
    for line in lines:
        log(line)
    seconds = time.perf_counter() - started

    def write(partial: Path) -> None:
        for name, samples in splits.items():
            _write_arrow(partial / f"{name}.arrow", samples, columns, length, name)
        meta = _meta(list(splits), columns, lines, stats, seconds)
        (partial / "meta.json").write_text(json.dumps(meta, indent=2))

    folder.parent.mkdir(parents=True, exist_ok=True)
    _write_entry(folder, write)
    log(f"tokenized data in {seconds:.2f} s, cached at {folder}")
    return _read_entry(folder, columns)[0], stats


def _meta(splits: list[str], columns: tuple, lines: list[str], stats: dict, seconds: float):
    return {
        "splits": splits,
        "columns": list(columns),
        "log": [getattr(line, "cached", line) for line in lines],
        "stats": stats,
        "encode_seconds": seconds,
    }


def _cached_entry(folder: Path, columns: tuple, log) -> tuple[dict, dict] | None:
    """(splits, stats) of a usable entry in `folder` (its lines logged again), else None; an
    unreadable or outdated entry is removed."""
    if LENGTH_COLUMN in columns:
        raise ValueError(f"the column name {LENGTH_COLUMN!r} is reserved for sample lengths")
    if not (folder / "meta.json").is_file():
        return None
    started = time.perf_counter()
    try:
        splits, meta = _read_entry(folder, columns)
    except Exception as exc:  # noqa: BLE001 - any unreadable entry is rebuilt, not fatal
        log(f"tokenized-data cache entry {folder} is unreadable ({exc!r}); re-tokenizing")
        shutil.rmtree(folder, ignore_errors=True)
        return None
    changed = first_changed_file(meta.get("stats", {}).get(FILES_READ, {}))
    if changed is not None:
        log(f"tokenized-data cache entry {folder}: {changed} changed since; re-encoding")
        shutil.rmtree(folder, ignore_errors=True)
        return None
    for line in meta["log"]:
        log(line)
    log(
        f"tokenized data loaded from cache in {time.perf_counter() - started:.2f} s "
        f"(encoding took {meta['encode_seconds']:.2f} s): {folder}"
    )
    return splits, meta.get("stats", {})


def load_or_stream_encode(
    folder: Path,
    encode_into: Callable[[Path], tuple[list[str], list[str], dict]],
    log: Callable[[str], None],
    *,
    columns: Sequence[str],
    keep: bool = True,
) -> tuple[dict[str, ArrowSamples], dict]:
    """Like load_or_encode_with_stats, for an encoding that writes its splits itself, chunk by
    chunk: `encode_into(private folder)` writes `<split>.arrow` there (SplitWriter) and returns
    (split names, log lines, stats). The entry is renamed into place only when whole.

    `keep=False` (--load_from_cache_file false): no entry is looked up or kept; the splits are
    written to a private folder, read back memory-mapped and the folder removed (the open
    mappings stay readable), so an uncached run holds no more in memory than a cached one.
    """
    columns = tuple(columns)
    hit = _cached_entry(folder, columns, log) if keep else None
    if hit is not None:
        return hit
    written: dict = {}

    def write(partial: Path) -> None:
        started = time.perf_counter()
        names, lines, stats = encode_into(partial)
        for line in lines:
            log(line)
        seconds = time.perf_counter() - started
        written.update(stats=stats, seconds=seconds)
        meta = _meta(names, columns, lines, stats, seconds)
        (partial / "meta.json").write_text(json.dumps(meta, indent=2))

    if not keep:
        folder = folder.with_name(f"{folder.name}.uncached-{os.getpid()}-{time.time_ns()}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    _write_entry(folder, write)
    try:
        splits = _read_entry(folder, columns)[0]
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
    if keep:
        log(f"tokenized data in {written['seconds']:.2f} s, cached at {folder}")
    return splits, written["stats"]


def sample_lengths(samples: Sequence[dict], length: Callable[[dict], int]) -> list[int]:
    """Token lengths of encoded samples: a cached file's stored column (or another Sequence
    that knows its `lengths` without decoding: data.token_shards), else `length` of each."""
    if isinstance(samples, ArrowSamples) or hasattr(samples, "lengths"):
        return samples.lengths
    return [length(sample) for sample in samples]
