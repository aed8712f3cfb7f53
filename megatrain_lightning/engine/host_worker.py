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
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

_Job = tuple[int, int, Future, Callable[..., Any], tuple, "Callable[[], bool] | None"]


class HostWorker:
    """A single daemon thread running submitted callables by priority (lowest first, FIFO among equals).

    Jobs reach the thread through a ``queue.SimpleQueue`` (its ``put`` is one C call) and wait in a heap only the
    thread touches, so the caller never holds a Python-level lock the thread needs: a KeyboardInterrupt raised in
    the caller mid-``submit`` (a signal handler runs between any two bytecodes) cannot leave the thread asleep or
    locked out, and :meth:`shutdown` cannot hang on it.

    Args:
        name: the thread's name (shows up in profilers and ``py-spy``).
        threads: intra-op threads for the jobs' torch ops (the fused AdamW kernel); ``None``: torch's
            default. Fewer than the cores leaves one to the thread that feeds the GPU, which must not be
            starved; the setting is this thread's own (``torch.get_num_threads()`` elsewhere is unchanged).
    """

    def __init__(self, name: str = "megatrain-host", threads: int | None = None) -> None:
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # None: close
        self._order = itertools.count()
        self._closed = False
        self._running = False  # the thread is inside a job's callable (not in its own bookkeeping)
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
        if self._closed:
            raise RuntimeError("the host worker has been shut down")
        fut: Future = Future()
        self._inbox.put((priority, next(self._order), fut, fn, args, ready))
        return fut

    @staticmethod
    def _take(jobs: list[_Job]) -> _Job:
        """The lowest-priority ready job, else the oldest one (``jobs`` not empty)."""
        ready = [j for j in jobs if j[5] is None or j[5]()]
        job = min(ready) if ready else min(jobs, key=lambda j: j[1])
        jobs.remove(job)
        heapq.heapify(jobs)
        return job

    def _run(self, started: threading.Event) -> None:
        if self._threads is not None:
            torch.ones(1 << 16).add_(1)  # torch sets a thread's OpenMP team size at its first parallel op...
            torch.set_num_threads(self._threads)  # ...so set ours after it, for this thread only
        started.set()
        jobs: list[_Job] = []  # this thread's own
        closing = False
        while True:
            if not jobs and not closing:
                item = self._inbox.get()  # blocks until a job or the close
                closing = item is None
                if item is not None:
                    heapq.heappush(jobs, item)
            while True:  # everything submitted meanwhile competes too
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                closing = closing or item is None
                if item is not None:
                    heapq.heappush(jobs, item)
            if not jobs:
                if closing:
                    return  # closed and drained
                continue
            _, _, fut, fn, args, _ = self._take(jobs)
            if not fut.set_running_or_notify_cancel():
                continue
            self._running = True
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to whoever waits on the future
                self._running = False
                fut.set_exception(exc)
            else:
                self._running = False
                fut.set_result(result)

    def shutdown(self) -> None:
        """Run what is queued, then stop the thread (waits for it). Sync point: every job has run when it returns,
        unless the thread is stuck outside any job (a lock of a future that the caller's interrupted wait left
        held): then it is left behind (a daemon), with one log line, rather than hanging the process."""
        self._closed = True
        self._inbox.put(None)
        stuck_since = None
        while self._thread.is_alive():
            self._thread.join(0.1)
            if self._running or not self._thread.is_alive():
                stuck_since = None
            elif stuck_since is None:
                stuck_since = time.monotonic()
            elif time.monotonic() - stuck_since > 10.0:
                log.warning("megatrain_lightning: the host worker thread is stuck outside its jobs (after an "
                            "interrupt); it is left behind")
                return
