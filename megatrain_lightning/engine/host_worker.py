"""The host worker: one thread that runs gradient accumulation and optimizer jobs, earliest deadline first.

Every job carries a priority: the position of its store in the next forward (the resident part that runs
before the first block is -1, block ``i`` is ``i``, the part after the last block comes last). The worker
always takes the queued job with the lowest priority, first come first served among equals. Why: the
backward delivers gradients last block first, while the next forward needs updated weights first block
first. When the host optimizer is slower than the backward, the jobs it has not reached by the end of the
backward are then done in the order the next forward needs them, and that forward can start as soon as
its first block is updated instead of after the last (earliest-deadline-first minimises the worst wait).

Only jobs that are *ready* compete: a job waits for its gradients' device→host copy, and the thread
that feeds the GPU runs ahead of it, so the newest job's copy is often still queued. The worker takes the
lowest-priority job whose ``ready()`` says so; when none is ready, the oldest job (whose copy was issued
first), and waits for it there. Jobs for one store keep their submission order (a later job's
``ready`` includes its predecessor's completion), which is all correctness needs: stores share no state.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from concurrent.futures import Future
from typing import Any, Callable

import torch


class HostWorker:
    """A single daemon thread running submitted callables by priority (lowest first, FIFO among equals).

    Args:
        name: the thread's name (shows up in profilers and ``py-spy``).
        threads: intra-op threads for the jobs' torch ops (the fused AdamW kernel); ``None``: torch's
            default. Fewer than the cores leaves one to the thread that feeds the GPU, which must not be
            starved; the setting is this thread's own (``torch.get_num_threads()`` elsewhere is unchanged).
    """

    def __init__(self, name: str = "megatrain-host", threads: int | None = None) -> None:
        self._queue: list[tuple[int, int, Future, Callable[..., Any], tuple, Callable[[], bool] | None]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._threads = threads
        started = threading.Event()
        caller_threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, args=(started,), name=name, daemon=True)
        self._thread.start()
        started.wait()
        if threads is not None:
            torch.set_num_threads(caller_threads)  # the process-wide count back; the worker keeps its own

    def submit(self, priority: int, fn: Callable[..., Any], *args: Any, ready: Callable[[], bool] | None = None) -> Future:
        """Queue ``fn(*args)``; its result or exception comes back through the returned future.

        ``ready``: whether the job can start without waiting (a copy's ``event.query``); None: always.
        """
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the host worker has been shut down")
            heapq.heappush(self._queue, (priority, next(self._order), fut, fn, args, ready))
            self._cond.notify()
        return fut

    def _take(self) -> tuple[Future, Callable[..., Any], tuple]:
        """The lowest-priority ready job, else the oldest one (caller holds the lock; queue not empty)."""
        ready = [j for j in self._queue if j[5] is None or j[5]()]
        job = min(ready) if ready else min(self._queue, key=lambda j: j[1])
        self._queue.remove(job)
        heapq.heapify(self._queue)
        return job[2], job[3], job[4]

    def _run(self, started: threading.Event) -> None:
        if self._threads is not None:
            torch.ones(1 << 16).add_(1)  # torch sets a thread's OpenMP team size at its first parallel op...
            torch.set_num_threads(self._threads)  # ...so set ours after it, for this thread only
        started.set()
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and drained
                fut, fn, args = self._take()
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
