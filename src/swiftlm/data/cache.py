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


def _write_arrow(path: Path, samples: list[dict], columns: Sequence[str], length, split: str):
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
    table = pa.table(arrays)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def _read_arrow(path: Path, columns: Sequence[str]) -> ArrowSamples:
    import pyarrow as pa

    return ArrowSamples(pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all(), columns)


def _write_entry(folder: Path, splits: dict[str, list[dict]], meta: dict, length) -> None:
    """Write every split into a private folder, then rename it into place: a reader sees a
    whole entry or none, and a failed write leaves nothing behind."""
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        for name, samples in splits.items():
            _write_arrow(partial / f"{name}.arrow", samples, meta["columns"], length, name)
        (partial / "meta.json").write_text(json.dumps(meta, indent=2))
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
    if LENGTH_COLUMN in columns:
        raise ValueError(f"the column name {LENGTH_COLUMN!r} is reserved for sample lengths")
    if (folder / "meta.json").is_file():
        started = time.perf_counter()
        try:
            splits, meta = _read_entry(folder, columns)
        except Exception as exc:  # noqa: BLE001 - any unreadable entry is rebuilt, not fatal
            log(f"tokenized-data cache entry {folder} is unreadable ({exc!r}); re-tokenizing")
            shutil.rmtree(folder, ignore_errors=True)
        else:
            changed = first_changed_file(meta.get("stats", {}).get(FILES_READ, {}))
            if changed is None:
                for line in meta["log"]:
                    log(line)
                log(
                    f"tokenized data loaded from cache in {time.perf_counter() - started:.2f} s "
                    f"(encoding took {meta['encode_seconds']:.2f} s): {folder}"
                )
                return splits, meta.get("stats", {})
            log(f"tokenized-data cache entry {folder}: {changed} changed since; re-encoding")
            shutil.rmtree(folder, ignore_errors=True)
    started = time.perf_counter()
    splits, lines, *rest = encode()
    stats = rest[0] if rest else {}
    for line in lines:
        log(line)
    seconds = time.perf_counter() - started
    meta = {
        "splits": list(splits),
        "columns": list(columns),
        "log": [getattr(line, "cached", line) for line in lines],
        "stats": stats,
        "encode_seconds": seconds,
    }
    folder.parent.mkdir(parents=True, exist_ok=True)
    _write_entry(folder, splits, meta, length)
    log(f"tokenized data in {seconds:.2f} s, cached at {folder}")
    return _read_entry(folder, columns)[0], stats


def sample_lengths(samples: Sequence[dict], length: Callable[[dict], int]) -> list[int]:
    """Token lengths of encoded samples: a cached file's stored column, else `length` of each."""
    if isinstance(samples, ArrowSamples):
        return samples.lengths
    return [length(sample) for sample in samples]
