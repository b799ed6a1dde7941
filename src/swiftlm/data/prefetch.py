"""Asynchronous prefetch: the next items of an iterator prepared in a background thread.

The training loop reads a step's samples and collates them while the previous step runs on
the accelerator (reading memory-mapped token shards and building tensors mostly waits on
page faults and C code, which release the GIL). Items come out in order and unchanged, so a
run with prefetch trains exactly like one without; an error in the thread is raised by the
`next()` that would have returned the failed item.
"""

import queue
import threading
from collections.abc import Callable, Iterator

_DONE = object()


def put_unless_stopped(into: queue.Queue, entry, stop: threading.Event) -> bool:
    """Queue one entry unless `stop` is set (then False): a producer thread waits in short
    slices, so it notices a consumer that stopped reading instead of blocking forever."""
    while not stop.is_set():
        try:
            into.put(entry, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


class Prefetcher:
    """Iterate `prepare(item)` for each item of `items`, `depth` items ahead, in a daemon
    thread. `close()` stops the thread (the loop calls it when training ends)."""

    def __init__(self, items: Iterator, prepare: Callable, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._fill, args=(items, prepare), name="swiftlm-prefetch", daemon=True
        )
        self._thread.start()

    def _put(self, entry) -> bool:
        return put_unless_stopped(self._queue, entry, self._stop)

    def _fill(self, items: Iterator, prepare: Callable) -> None:
        try:
            for item in items:
                if not self._put((prepare(item), None)):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self._put((None, exc))
            return
        self._put((_DONE, None))

    def __iter__(self):
        return self

    def __next__(self):
        if self._stop.is_set():
            raise StopIteration
        value, error = self._queue.get()
        if error is not None:
            self.close()
            raise error
        if value is _DONE:
            self.close()
            raise StopIteration
        return value

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Prepared(list):
    """A step's micro-batches already collated by a Prefetcher (the loop uses them as they
    are instead of collating the sample indices)."""


def prefetch_steps(steps: Iterator, collate: Callable) -> Prefetcher:
    """(Prepared batches, position) for each (sample indices, position) of `steps`."""
    return Prefetcher(steps, lambda step: (Prepared(collate(step[0])), step[1]))
