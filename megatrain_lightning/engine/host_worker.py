"""The host worker: one thread that runs gradient accumulation and optimizer jobs, earliest deadline first.

Every job carries a priority: the position of its store in the next forward (the resident part that runs
before the first block is -1, block ``i`` is ``i``, the part after the last block comes last). The worker
always takes the queued job with the lowest priority, first come first served among equals. Why: the
backward delivers gradients last block first, while the next forward needs updated weights first block
first. When the host optimizer is slower than the backward, the jobs it has not reached by the end of the
backward are then done in the order the next forward needs them, and that forward can start as soon as
its first block is updated instead of after the last (earliest-deadline-first minimises the worst wait).

Jobs for one store keep their submission order (equal priority), which is all that correctness needs:
different stores share no state.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from concurrent.futures import Future
from typing import Any, Callable


class HostWorker:
    """A single daemon thread running submitted callables by priority (lowest first, FIFO among equals).

    Args:
        name: the thread's name (shows up in profilers and ``py-spy``).
    """

    def __init__(self, name: str = "megatrain-host") -> None:
        self._queue: list[tuple[int, int, Future, Callable[..., Any], tuple]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, priority: int, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)``; its result or exception comes back through the returned future."""
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the host worker has been shut down")
            heapq.heappush(self._queue, (priority, next(self._order), fut, fn, args))
            self._cond.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and drained
                _, _, fut, fn, args = heapq.heappop(self._queue)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                fut.set_exception(exc)

    def shutdown(self) -> None:
        """Run what is queued, then stop the thread (waits for it)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
