"""What filled the GPU when a CUDA out-of-memory error stops a run, and what to change.

`oom_guard(run_dir, device, log)` wraps training. When a `torch.OutOfMemoryError` escapes, it
writes, before anything is freed:

- `<run_dir>/oom/memory_snapshot.pickle`: the allocator state (`torch.cuda.memory._snapshot()`,
  the format `_dump_snapshot` writes), to open in https://pytorch.org/memory_viz. With the
  allocation history of `start_oom_history` it holds each live block's Python stack and the
  last allocations before the failure.
- `<run_dir>/oom/summary.txt`: allocated / reserved / total / peak memory, the largest live
  blocks (with the code that allocated them when history was recorded), the fragmentation of
  the cache, and what to change, most effective first.

and raises `DeviceOutOfMemoryError` (a SwiftLMError: the CLI prints its message, not a
traceback) naming the summary, chained to the original error.

The summary is a pure function of the snapshot dict (`summarize_oom`), so it is tested on CPU
with a synthetic snapshot. In a distributed run each rank writes its own files
(`rank-N-summary.txt` ...), as ranks run out of memory independently.
"""

import contextlib
import pickle
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from swiftlm.errors import SwiftLMError

OOM_FOLDER = "oom"
GIB = 1024**3
# Allocation history kept for the snapshot: at most this many alloc/free events (a ring
# buffer; each holds a Python stack, a few KB of host memory: ~50 MB at most).
OOM_HISTORY_ENTRIES = 10_000
LARGEST_BLOCKS = 10
FRAMES_PER_BLOCK = 4
# Cached but unused memory above this share of what is reserved counts as fragmentation worth
# acting on: the allocator could not reuse it for the failed request.
FRAGMENTATION_SHARE = 0.15

_history = {"on": False}  # whether start_oom_history turned allocation history on


class DeviceOutOfMemoryError(SwiftLMError):
    """The GPU ran out of memory; the message names the summary and what to change."""


def start_oom_history(device: torch.device) -> None:
    """Record allocation history on CUDA, so an out-of-memory snapshot shows who allocated.

    Cost: every allocation and free records its Python stack (`stacks="python"`, about 2 us
    each; no C++ frames, whose symbolization would take minutes at dump time); tracebacks are
    kept for allocations only (`context="alloc"`), and the history is a ring buffer of
    OOM_HISTORY_ENTRIES events. That is well under 1% of a training step, so it is on for
    every CUDA run. A no-op elsewhere.
    """
    if device.type != "cuda":
        return
    try:
        torch.cuda.memory._record_memory_history(
            enabled="all", context="alloc", stacks="python", max_entries=OOM_HISTORY_ENTRIES
        )
    except (RuntimeError, TypeError, AttributeError):  # a build without it: snapshot w/o stacks
        return
    _history["on"] = True


def stop_oom_history(device: torch.device) -> None:
    if device.type == "cuda" and _history["on"]:
        with contextlib.suppress(RuntimeError, TypeError, AttributeError):
            torch.cuda.memory._record_memory_history(enabled=None)
    _history["on"] = False


def oom_history_on() -> bool:
    """Whether start_oom_history is recording (the profiler puts it back after its window)."""
    return _history["on"]


@contextlib.contextmanager
def oom_guard(run_dir: Path, device: torch.device, log: Callable[[str], None]) -> Iterator[None]:
    """Turn a CUDA out-of-memory error into a snapshot, a summary and a clear SwiftLMError."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        summary_path = write_oom_report(Path(run_dir), device, str(exc), log)
        raise DeviceOutOfMemoryError(oom_message(str(exc), summary_path)) from exc


def write_oom_report(run_dir: Path, device: torch.device, error_text: str, log) -> Path | None:
    """Write the snapshot and summary; return the summary's path (None if it failed).

    Never raises: a failure here must not hide the out-of-memory error itself.
    """
    folder = run_dir / OOM_FOLDER
    prefix = _rank_prefix()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        snapshot, stats = {"segments": []}, {}
        if device.type == "cuda":
            snapshot = take_snapshot(device)
            stats = memory_stats(device)
            with (folder / f"{prefix}memory_snapshot.pickle").open("wb") as f:
                pickle.dump(snapshot, f)
        summary = summarize_oom(snapshot, stats, error_text)
        path = folder / f"{prefix}summary.txt"
        path.write_text(summary, encoding="utf-8")
    except Exception as exc:  # noqa: BLE001 - anything: the OOM error is what must surface
        log(f"could not write the out-of-memory summary to {folder}: {exc}")
        return None
    log(summary)
    return path


def take_snapshot(device: torch.device) -> dict:
    """The allocator's state: segments, blocks and (with history) their stacks and traces."""
    return torch.cuda.memory._snapshot(device)


def memory_stats(device: torch.device) -> dict:
    """Bytes: allocated, reserved, peak allocated, and the device's total memory."""
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak": torch.cuda.max_memory_allocated(device),
        "total": torch.cuda.get_device_properties(device).total_memory,
    }


def _rank_prefix() -> str:
    """'' in one process; 'rank-N-' when several ranks may write into the same folder."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return f"rank-{dist.get_rank()}-"
    return ""


def oom_message(error_text: str, summary_path: Path | None) -> str:
    requested = requested_bytes(error_text)
    what = f" while allocating {gib(requested)}" if requested else ""
    where = (
        f"What used the memory and what to change: {summary_path} (the allocator snapshot "
        "next to it opens in https://pytorch.org/memory_viz)."
        if summary_path
        else "The out-of-memory summary could not be written (see the line above)."
    )
    return (
        f"the GPU ran out of memory{what}. {where} Most effective first: lower "
        "--per_device_train_batch_size (or use --per_device_train_batch_size auto), "
        "--gradient_checkpointing true, LoRA/QLoRA instead of full fine-tuning."
    )


def gib(size: float) -> str:
    return f"{size / GIB:.2f} GiB"


_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": GIB, "TiB": 1024**4}


def requested_bytes(error_text: str) -> int | None:
    """The size the failed allocation asked for, read from torch's message."""
    match = re.search(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)", error_text)
    return int(float(match.group(1)) * _UNITS[match.group(2)]) if match else None


def summarize_oom(snapshot: dict | list, stats: dict, error_text: str = "") -> str:
    """A readable account of a memory snapshot at an out-of-memory error.

    `snapshot` is `torch.cuda.memory._snapshot()` (a dict with "segments") or
    `torch.cuda.memory_snapshot()` (the list of segments); `stats` holds byte counts
    ("allocated", "reserved", "peak", "total"), any of them missing; the snapshot's own sums
    stand in for allocated and reserved.
    """
    segments = snapshot.get("segments", []) if isinstance(snapshot, dict) else snapshot
    blocks = [b for s in segments for b in s.get("blocks", [])]
    live = [b for b in blocks if b.get("state") == "active_allocated"]
    allocated = stats.get("allocated", sum(b.get("size", 0) for b in live))
    reserved = stats.get("reserved", sum(s.get("total_size", 0) for s in segments))
    free_cached = max(0, reserved - allocated)
    largest_free = max(
        (b.get("size", 0) for b in blocks if b.get("state") == "inactive"), default=0
    )
    requested = requested_bytes(error_text)
    fragmented = is_fragmented(free_cached, reserved, largest_free, requested)
    lines = ["CUDA out of memory", ""]
    if error_text:
        lines += ["torch: " + error_text.strip().splitlines()[0], ""]
    lines += _memory_lines(stats, allocated, reserved, requested)
    lines += _fragmentation_lines(free_cached, reserved, largest_free, len(segments), fragmented)
    lines += _block_lines(live)
    lines += ["", "What to change, most effective first:"]
    lines += [f"  {i}. {s}" for i, s in enumerate(suggestions(fragmented), start=1)]
    return "\n".join(lines) + "\n"


def is_fragmented(free_cached: int, reserved: int, largest_free: int, requested) -> bool:
    """A large share of the cache is free, yet (when the request is known) no free block is
    big enough for it: the memory exists but in pieces."""
    if reserved <= 0 or free_cached < FRAGMENTATION_SHARE * reserved:
        return False
    return requested is None or largest_free < requested


def _memory_lines(stats: dict, allocated: int, reserved: int, requested) -> list[str]:
    lines = [f"allocated by tensors: {gib(allocated)}", f"reserved by the cache: {gib(reserved)}"]
    if "peak" in stats:
        lines.append(f"peak allocated this run: {gib(stats['peak'])}")
    if "total" in stats:
        lines.append(f"device total: {gib(stats['total'])}")
    if requested:
        lines.append(f"the failed allocation asked for: {gib(requested)}")
    return lines


def _fragmentation_lines(free, reserved, largest_free, n_segments, fragmented) -> list[str]:
    share = free / reserved if reserved else 0.0
    verdict = "high: the cache holds free memory it cannot use" if fragmented else "low"
    return [
        "",
        f"fragmentation (reserved - allocated): {gib(free)} ({share:.0%} of reserved, "
        f"{n_segments} segments, largest free block {gib(largest_free)}): {verdict}",
    ]


def _block_lines(live: list[dict]) -> list[str]:
    if not live:
        return ["", "no live blocks in the snapshot"]
    largest = sorted(live, key=lambda b: b.get("size", 0), reverse=True)[:LARGEST_BLOCKS]
    lines = ["", f"largest live blocks ({len(largest)} of {len(live)}):"]
    for block in largest:
        lines.append(f"  {gib(block.get('size', 0))}")
        lines += [f"      {frame}" for frame in block_frames(block)]
    if not any(b.get("frames") for b in largest):
        lines.append(
            "  (no stacks: allocation history was not recording; swiftlm records it on CUDA "
            "from the start of training)"
        )
    return lines


def block_frames(block: dict) -> list[str]:
    """The innermost frames of the code that allocated a block, torch's own frames skipped."""
    frames = block.get("frames") or []
    ours = [f for f in frames if "/torch/" not in str(f.get("filename", "")).replace("\\", "/")]
    return [
        f"{f.get('filename', '?')}:{f.get('line', '?')} in {f.get('name', '?')}"
        for f in (ours or frames)[:FRAMES_PER_BLOCK]
    ]


def suggestions(fragmented: bool) -> list[str]:
    """What to change, the cheapest big saving first."""
    found = [
        "lower --per_device_train_batch_size (raise --gradient_accumulation_steps to keep the "
        "batch), cap tokens per micro-batch with --max_tokens_per_batch, lower --max_length, "
        "or let swiftlm pick: --per_device_train_batch_size auto",
        "--gradient_checkpointing true: recompute activations in backward instead of keeping them",
        "--train_type lora (or QLoRA: add --quant_method bnb --quant_bits 4) instead of full "
        "fine-tuning: no optimizer state for the frozen weights",
        "--torch_dtype bfloat16 if the run computes in float32",
        "shard across GPUs: --nproc_per_node N with --strategy fsdp2 (add --fsdp_offload true) "
        "or --deepspeed zero3 (zero3_offload to use CPU memory)",
        "long rows: --sequence_parallel_size N with --nproc_per_node N cuts each row's tokens "
        "(activations, logits) into N shards, one per GPU",
    ]
    alloc_conf = (
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the environment: lets the cache "
        "grow segments instead of leaving unusable gaps"
    )
    return [alloc_conf, *found] if fragmented else [*found, alloc_conf]
