"""Tokenized datasets cached on disk as Arrow, so a second run skips reading, validating and
tokenizing.

The cache key is a hash of everything the encoded samples depend on: the content of every
local data file (not its name or date), the built-in or hub dataset names, the data options
(max_length, truncation, loss scope, system prompt, split, seeds, placeholders) and the
tokenizer itself (its full serialized vocabulary and chat template). Change any of them and
the run re-tokenizes into a new entry. Hub datasets are keyed by name only: pass
`--load_from_cache_file false` after the hub copy changes.

Entries are written to a temporary folder and renamed into place, so an interrupted run never
leaves a half-written entry behind. Training reads the Arrow file memory-mapped.
"""

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from swiftlm.data.sources import BUILTIN_DATASETS, builtin_dataset_path, parse_dataset_spec

# Bump when the encoding itself changes (masking rules, truncation), so old entries are unused.
ENCODING_VERSION = 2
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


def _to_dataset(samples: list[dict]):
    from datasets import Dataset

    columns = {name: [s[name] for s in samples] for name in COLUMNS}
    columns["length"] = [len(s["input_ids"]) for s in samples]
    return Dataset.from_dict(columns)


def _write_entry(folder: Path, splits: dict[str, list[dict]], meta: dict) -> None:
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    for name, samples in splits.items():
        if samples:  # datasets cannot read back an empty saved dataset
            _to_dataset(samples).save_to_disk(str(partial / name))
    (partial / "meta.json").write_text(json.dumps(meta, indent=2))
    try:
        partial.rename(folder)
    except OSError:  # another process finished the same entry first: keep theirs
        shutil.rmtree(partial, ignore_errors=True)


def _read_entry(folder: Path) -> tuple[dict, dict]:
    from datasets import load_from_disk

    meta = json.loads((folder / "meta.json").read_text())
    splits = {
        name: load_from_disk(str(folder / name)) if (folder / name).is_dir() else []
        for name in meta["splits"]
    }
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
    """Token lengths of encoded samples: a cached dataset's column, or counted from a list."""
    if hasattr(samples, "column_names") and "length" in samples.column_names:
        return list(samples["length"])
    return [len(s["input_ids"]) for s in samples]
