"""The cache key of a large local corpus: like data.cache.cache_key (the content of every
file, the options, the tokenizer), with each file's content digest remembered by its
(size, modification time), so a later run, a resume, re-reads none of the corpus to find its
entry.

Hashing 2 GB takes seconds (more on a busy machine), which a resume that should reach its
first step in seconds cannot pay every time. A file whose size or time changed is hashed
again; one rewritten with the same size within the file system's time resolution would not
be noticed (as `make` would not): pass `--load_from_cache_file false` after such an edit.
"""

import hashlib
import json
import os
from pathlib import Path

from swiftlm.data.cache import ENCODING_VERSION, _tokenizer_fingerprint, data_cache_root

DIGESTS_FILE = "file-digests.json"


def _load_digests(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _save_digests(path: Path, digests: dict) -> None:
    """Atomically (a private file renamed over the old one): concurrent runs never read half
    a file; the last writer wins, and a lost entry only costs one hash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    partial.write_text(json.dumps(digests))
    partial.replace(path)


def file_digest(path: Path, digests: dict) -> str:
    """sha256 of the file's content, from `digests` when its size and time are unchanged."""
    stat = path.stat()
    name = str(path.resolve())
    known = digests.get(name)
    if known and known[:2] == [stat.st_size, stat.st_mtime_ns]:
        return known[2]
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    digests[name] = [stat.st_size, stat.st_mtime_ns, digest]
    return digest


def corpus_key(files_by_spec: dict[str, list[Path]], options: dict, tokenizer) -> str:
    """Hex digest of the specs, their files' content, `options` and the tokenizer."""
    memo = data_cache_root() / DIGESTS_FILE
    digests = _load_digests(memo)
    before = json.dumps(digests, sort_keys=True)
    key = hashlib.sha256()
    key.update(json.dumps({"v": ENCODING_VERSION, **options}, sort_keys=True).encode())
    for spec, files in files_by_spec.items():
        key.update(spec.encode())
        for file in files:
            key.update(str(file).encode())
            key.update(file_digest(file, digests).encode())
    key.update(_tokenizer_fingerprint(tokenizer).encode())
    if json.dumps(digests, sort_keys=True) != before:
        _save_digests(memo, digests)
    return key.hexdigest()[:32]
