"""Checkpoint writes in a background thread (--async_save) for the engines that write plain
files (one process, DDP, pipeline stages, the block store); FSDP2/TP use DCP's own.

A save in two halves: the tensors are copied to CPU memory now (`Staging`; pinned buffers,
kept for the next save, when they live on a GPU), then a thread writes the files while
training goes on. The Future handed back ends once the files are written and its callbacks
(`folders.mark_complete_when_written`: COMPLETE) have run; a failed write ends it with the
error, so the folder gets no COMPLETE, and `sharded.PendingSave.wait` (called by the next
save and at the end of training) raises it. One write is in flight at a time.
"""

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Staging:
    """CPU copies of the tensors a background write reads, so training may change the live
    ones meanwhile. On CUDA the copies go into pinned buffers reused from save to save."""

    def __init__(self):
        self._pinned: dict[str, torch.Tensor] = {}

    def copy(self, tensors: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
        """Copies of `tensors`; names that share one tensor (tied weights) share one copy."""
        copies, by_tensor, on_gpu = {}, {}, False
        for name, tensor in tensors.items():
            tensor = tensor.detach()
            key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
            if key not in by_tensor:
                on_gpu |= tensor.device.type == "cuda"
                by_tensor[key] = self._copy_one(prefix + name, tensor)
            copies[name] = by_tensor[key]
        if on_gpu:
            torch.cuda.synchronize()  # the non-blocking copies must land before the write
        return copies

    def _copy_one(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cuda":
            return tensor.clone(memory_format=torch.contiguous_format)
        buffer = self._pinned.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._pinned[name] = buffer
        return buffer.copy_(tensor, non_blocking=True)


class BackgroundWriter:
    """One thread that runs checkpoint writes, in order."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, write: Callable[[], object]) -> tuple[Future, Future]:
        """Run `write` in the background. Returns (the write's Future for COMPLETE callbacks,
        the Future to wait on): the latter ends after the former's callbacks have run."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        written: Future = Future()

        def run():
            try:
                result = write()
            except BaseException as exc:
                written.set_exception(exc)  # no COMPLETE: its callback sees the error
                raise
            written.set_result(result)  # runs the callbacks here, before `run` returns
            return result

        return written, self._pool.submit(run)
