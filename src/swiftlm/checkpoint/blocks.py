"""Incremental checkpoints (--incremental_checkpoints): tensors as content-addressed blocks.

A checkpoint folder in block format holds `blocks.json` (its manifest) instead of the
weights and optimizer safetensors; every other file (configs, tokenizer, optimizer.json,
RNG, trainer_state.json, COMPLETE) is as in the standard format. The tensor bytes live in a
store shared by the checkpoints beside it:

    <run>/checkpoints/step-N/blocks.json       the manifest of step N
    <run>/checkpoints/blocks/ab/abcdef....bin  one block: up to BLOCK_SIZE bytes, named by the
                                               sha256 hash of its bytes

Each group of tensors ("model": the weights as `save_pretrained` would name them, "optimizer":
the optimizer's tensors as `tensors.optimizer_to_files` names them) is laid out as one byte
stream, each tensor at a 64-byte aligned offset; a tensor of at least OWN_BLOCKS_AT (64 KiB)
starts a new block and ends its last one, so a tensor that does not change (frozen
embeddings, a frozen base, unchanged optimizer entries) keeps the same blocks and they are
not written again. Smaller tensors share blocks. The manifest lists per group its blocks (hash, size) in stream
order and per tensor its dtype, shape, offset and size. Nothing here unpickles.

For copying a checkpoint elsewhere (a mirror tier), `checkpoint_files(folder)` lists every
file a block-format (or standard) checkpoint needs: the folder's own files and the blocks its
manifest references, as absolute paths; paths relative to `folder.parent` keep the layout.

Blocks are removed only by `collect_garbage` (after `folders.prune_checkpoints` deleted
folders): a block that no manifest in the store's folder references is deleted. A save
writes its manifest before its blocks, both under the store's lock, so garbage collection
never removes a block a save in flight counts on.
"""

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from swiftlm.errors import CheckpointError

MANIFEST = "blocks.json"
STORE = "blocks"
MODEL_GROUP, OPTIMIZER_GROUP = "model", "optimizer"
BLOCK_SIZE = 4 * 1024 * 1024
OWN_BLOCKS_AT = 64 * 1024  # a tensor this large starts and ends its own blocks
ALIGN = 64  # every tensor starts at a multiple of this in its stream (any dtype can view it)
FORMAT = "swiftlm-blocks"
HASH = "sha256"  # the fastest stdlib hash here (SHA extensions): ~750 MB/s a core, blake2b ~400
HASH_HEX = 40  # the first 160 bits of the digest name a block
DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


@dataclass
class WriteStats:
    """What one save wrote: bytes and blocks new to the store, blocks it reused."""

    bytes_written: int = 0
    blocks_written: int = 0
    blocks_reused: int = 0
    bytes_total: int = 0


def store_of(folder: Path) -> Path:
    """The block store of a checkpoint folder: shared with its sibling checkpoints."""
    return folder.parent / STORE


def is_block_checkpoint(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def block_path(store: Path, digest: str) -> Path:
    return store / digest[:2] / f"{digest}.bin"


# ---- layout: tensors -> stream -> blocks ------------------------------------------------------


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().cpu().contiguous().reshape(-1)  # no copy for a CPU tensor
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _layout(tensors: dict[str, torch.Tensor]) -> tuple[dict, list[list[memoryview]]]:
    """(tensor entries with their stream offsets, the blocks as lists of byte pieces)."""
    entries, blocks, current, filled, offset = {}, [], [], 0, 0

    def cut():
        nonlocal current, filled
        if current:
            blocks.append(current)
        current, filled = [], 0

    for name, tensor in tensors.items():
        data = _bytes_of(tensor)
        size = len(data)
        if size >= OWN_BLOCKS_AT:
            cut()  # a large tensor owns its blocks: unchanged, they hash the same
        entries[name] = {
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "offset": offset,
            "nbytes": size,
        }
        padded = -size % ALIGN
        pieces = [data, memoryview(bytes(padded))] if padded else [data]
        for piece in pieces:
            while len(piece):
                take = min(len(piece), BLOCK_SIZE - filled)
                current.append(piece[:take])
                filled, piece = filled + take, piece[take:]
                if filled == BLOCK_SIZE:
                    cut()
        offset += size + padded
        if size >= OWN_BLOCKS_AT:
            cut()
    cut()
    return entries, blocks


def _digest(pieces: list[memoryview]) -> str:
    digest = hashlib.new(HASH)
    for piece in pieces:
        digest.update(piece)  # releases the GIL for large pieces: hashing runs in parallel
    return digest.hexdigest()[:HASH_HEX]


def plan_groups(groups: dict[str, dict[str, torch.Tensor]]) -> tuple[dict, dict[str, list]]:
    """The manifest's groups and {hash: byte pieces} of every block they need."""
    manifest, pieces_of = {}, {}
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        for group, tensors in groups.items():
            entries, blocks = _layout(tensors)
            digests = list(pool.map(_digest, blocks))
            sizes = [sum(len(p) for p in pieces) for pieces in blocks]
            manifest[group] = {
                "tensors": entries,
                "blocks": [list(b) for b in zip(digests, sizes, strict=True)],
            }
            pieces_of.update(zip(digests, blocks, strict=True))
    return manifest, pieces_of


# ---- writing ----------------------------------------------------------------------------------


@contextmanager
def store_lock(store: Path) -> Iterator[None]:
    """Excludes garbage collection while a save registers its blocks (threads and processes)."""
    store.mkdir(parents=True, exist_ok=True)
    with open(store / ".lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_atomically(path: Path, pieces: list) -> None:
    """Write under a temporary name, then rename: a crash never leaves a torn block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with open(partial, "wb") as file:
        for piece in pieces:
            file.write(piece)
    os.replace(partial, path)


def write_block_checkpoint(
    folder: Path, groups: dict[str, dict[str, torch.Tensor]], meta: dict | None = None
) -> WriteStats:
    """Write `groups` of tensors into `folder` as a manifest + the blocks the store lacks."""
    layout, pieces_of = plan_groups(groups)
    manifest = {"format": FORMAT, "version": 1, "hash": HASH, "block_size": BLOCK_SIZE}
    manifest.update(meta or {})
    manifest["groups"] = layout
    store = store_of(folder)
    text = json.dumps(manifest).encode()
    with store_lock(store):  # from here on garbage collection sees this save's blocks
        _write_atomically(folder / MANIFEST, [text])
    stats = WriteStats(bytes_total=sum(sum(map(len, p)) for p in pieces_of.values()))
    for digest, pieces in pieces_of.items():
        path = block_path(store, digest)
        if path.is_file():
            stats.blocks_reused += 1
            continue
        _write_atomically(path, pieces)
        stats.blocks_written += 1
        stats.bytes_written += sum(len(p) for p in pieces)
    return stats


# ---- reading ----------------------------------------------------------------------------------


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read the block manifest {path}: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a swiftlm block manifest (format {FORMAT})")
    return manifest


def read_group(folder: Path, group: str, manifest: dict | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one group, read straight from the blocks into one buffer (the tensors
    are views of it). CheckpointError names a missing or truncated block."""
    manifest = manifest or read_manifest(folder)
    layout = manifest["groups"].get(group)
    if layout is None:
        return {}
    store = store_of(folder)
    total = sum(size for _, size in layout["blocks"])
    buffer = torch.empty(total, dtype=torch.uint8)
    view, start = memoryview(buffer.numpy()), 0
    for digest, size in layout["blocks"]:
        _read_block(block_path(store, digest), view[start : start + size], folder)
        start += size
    tensors = {}
    for name, entry in layout["tensors"].items():
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{folder / MANIFEST}: {name} has unknown dtype {entry['dtype']}")
        raw = buffer[entry["offset"] : entry["offset"] + entry["nbytes"]]
        tensors[name] = raw.view(dtype).reshape(entry["shape"])
    return tensors


def _read_block(path: Path, into: memoryview, folder: Path) -> None:
    try:
        with open(path, "rb", buffering=0) as file:
            got = file.readinto(into)
    except FileNotFoundError:
        raise CheckpointError(
            f"{folder}: block {path} is missing (was the block store {path.parent.parent} "
            "deleted or copied without it?); resume from another checkpoint"
        ) from None
    if got != len(into):
        raise CheckpointError(f"{folder}: block {path} is truncated ({got} of {len(into)} bytes)")


# ---- what a checkpoint needs; garbage collection ---------------------------------------------


def referenced_blocks(folder: Path) -> set[str]:
    """Hashes of the blocks a checkpoint folder's manifest references (none: not in blocks)."""
    if not is_block_checkpoint(folder):
        return set()
    manifest = read_manifest(folder)
    return {digest for layout in manifest["groups"].values() for digest, _ in layout["blocks"]}


def checkpoint_files(folder: Path) -> list[Path]:
    """Every file a checkpoint needs, absolute: its own files, then its blocks in the store."""
    own = sorted(p for p in folder.rglob("*") if p.is_file())
    store = store_of(folder)
    return own + [block_path(store, digest) for digest in sorted(referenced_blocks(folder))]


def collect_garbage(checkpoints_root: Path) -> tuple[int, int]:
    """Delete the blocks of `checkpoints_root/blocks` that no checkpoint folder beside it
    references (complete or not: a save in flight has written its manifest first).
    Returns (blocks removed, bytes freed)."""
    store = checkpoints_root / STORE
    if not store.is_dir():
        return 0, 0
    removed = freed = 0
    with store_lock(store):
        kept = set()
        for folder in checkpoints_root.iterdir():
            if folder.is_dir() and folder.name != STORE:
                try:
                    kept |= referenced_blocks(folder)
                except CheckpointError:  # a manifest not readable: keep every block
                    return 0, 0
        for path in store.glob("??/*.bin"):
            if path.stem not in kept:
                freed += path.stat().st_size
                path.unlink()
                removed += 1
    return removed, freed
