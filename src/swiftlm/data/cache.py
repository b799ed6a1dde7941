"""Tokenized datasets cached on disk as Arrow, so a second run skips reading, validating and
tokenizing.

The cache key is a hash of everything the encoded samples depend on: the content of every
local data file (not its name or date), the built-in or hub dataset names, the data options
(max_length, truncation, loss scope, system prompt, split, seeds, placeholders) and the
tokenizer itself (its full serialized vocabulary and chat template). Change any of them and
the run re-tokenizes into a new entry. Hub datasets are keyed by name only: pass
`--load_from_cache_file false` after the hub copy changes.

Entries are written to a temporary folder and renamed into place, so an interrupted run never
leaves a half-written entry behind. Each split is one Arrow IPC file, read memory-mapped with
pyarrow: a row is decoded when a batch needs it, and the `datasets` import is not paid.
"""

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from swiftlm.data.sources import BUILTIN_DATASETS, builtin_dataset_path, parse_dataset_spec

# Bump when the encoding itself changes (masking rules, truncation), so old entries are unused.
ENCODING_VERSION = 3
COLUMNS = ("input_ids", "labels")


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
    """Encoded samples read from a memory-mapped Arrow file: `samples[i]` is a dict of lists,
    like the in-memory list it replaces, and only the rows asked for are decoded."""

    def __init__(self, table):
        self.table = table
        self._columns = {name: table.column(name) for name in (*COLUMNS, "length")}

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, index: int) -> dict:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return {name: self._columns[name][index].as_py() for name in COLUMNS}

    @property
    def lengths(self) -> list[int]:
        return self._columns["length"].to_pylist()


def _write_arrow(path: Path, samples: list[dict]) -> None:
    import pyarrow as pa

    table = pa.table(
        {
            **{
                name: pa.array([s[name] for s in samples], type=pa.list_(pa.int32()))
                for name in COLUMNS
            },
            "length": pa.array([len(s["input_ids"]) for s in samples], type=pa.int32()),
        }
    )
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def _read_arrow(path: Path) -> ArrowSamples:
    import pyarrow as pa

    return ArrowSamples(pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all())


def _write_entry(folder: Path, splits: dict[str, list[dict]], meta: dict) -> None:
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name, samples in splits.items():
        _write_arrow(partial / f"{name}.arrow", samples)
    (partial / "meta.json").write_text(json.dumps(meta, indent=2))
    try:
        partial.rename(folder)
    except OSError:  # another process finished the same entry first: keep theirs
        shutil.rmtree(partial, ignore_errors=True)


def _read_entry(folder: Path) -> tuple[dict, dict]:
    meta = json.loads((folder / "meta.json").read_text())
    splits = {name: _read_arrow(folder / f"{name}.arrow") for name in meta["splits"]}
    return splits, meta


def load_or_encode(
    folder: Path,
    encode: Callable[[], tuple[dict[str, list[dict]], list[str]]],
    log: Callable[[str], None],
) -> dict:
    """The encoded splits from `folder`, or from `encode()` (then saved to `folder`).

    `encode` returns ({split name: samples}, log lines); the lines are stored and printed
    again on a cache hit, so a cached run reports the same truncation and skipped rows.
    """
    if (folder / "meta.json").is_file():
        started = time.perf_counter()
        try:
            splits, meta = _read_entry(folder)
        except Exception as exc:  # noqa: BLE001 - any unreadable entry is rebuilt, not fatal
            log(f"tokenized-data cache entry {folder} is unreadable ({exc!r}); re-tokenizing")
            shutil.rmtree(folder, ignore_errors=True)
        else:
            for line in meta["log"]:
                log(line)
            log(
                f"tokenized data loaded from cache in {time.perf_counter() - started:.2f} s "
                f"(encoding took {meta['encode_seconds']:.2f} s): {folder}"
            )
            return splits
    started = time.perf_counter()
    splits, lines = encode()
    for line in lines:
        log(line)
    seconds = time.perf_counter() - started
    meta = {"splits": list(splits), "log": lines, "encode_seconds": seconds}
    folder.parent.mkdir(parents=True, exist_ok=True)
    _write_entry(folder, splits, meta)
    log(f"tokenized data in {seconds:.2f} s, cached at {folder}")
    return splits


def sample_lengths(samples) -> list[int]:
    """Token lengths of encoded samples: a cached file's column, or counted from a list."""
    if isinstance(samples, ArrowSamples):
        return samples.lengths
    return [len(s["input_ids"]) for s in samples]
