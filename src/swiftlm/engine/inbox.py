"""What callers on any thread hand an engine's loop thread: submitted requests, aborts and
the stop. The loop takes everything at once (`take`), sleeping while there is nothing to do;
both the continuous-batching engine and the vLLM one run on it."""

import threading
from collections.abc import Callable
from typing import Any


class Inbox:
    def __init__(self):
        self._lock = threading.Condition()
        self._incoming: list[Any] = []
        self._aborted: set[str] = set()
        self._stopping = False

    def put(self, submission: Any) -> None:
        """Hand the loop a submission; refused once the engine is stopping."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("the engine is shut down")
            self._incoming.append(submission)
            self._lock.notify()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborted.add(request_id)
            self._lock.notify()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()

    def waiting(self) -> int:
        """Submissions the loop has not taken yet."""
        with self._lock:
            return len(self._incoming)

    def take(self, busy: Callable[[], bool]) -> tuple[list[Any], set[str], bool]:
        """(submissions, aborted request ids, stopping), all handed over since the last call;
        waits for one of them unless `busy()` (the loop has work of its own)."""
        with self._lock:
            while not (self._incoming or self._aborted or self._stopping or busy()):
                self._lock.wait()
            incoming, self._incoming = self._incoming, []
            aborted, self._aborted = self._aborted, set()
            return incoming, aborted, self._stopping
