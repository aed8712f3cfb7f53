"""The overlapped optimizer updates in flight, and the rule that guards the masters they write.

A store's update runs on the host worker as soon as its gradients are home; with
``overlap_next_forward`` it may still be running when the next step begins. Buffer lifetime: a store's
masters may be copied to the device only after its own update has run (:meth:`UpdateTracker.wait_for`),
and nothing else may read or write masters, moments or ``.grad`` until :meth:`UpdateTracker.wait_all`.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from .replicas import Replicas
from .stats import EngineStats
from .store import FlatStore


class UpdateTracker:
    """Futures of the updates handed out this step, by store key (block index, ``RESIDENT``, ...)."""

    def __init__(self, stats: EngineStats, replicas: Replicas | None = None) -> None:
        self.stats = stats
        self.replicas = replicas or Replicas()
        # Data parallel: the stores another rank of the node updates, by key; this rank waits for their
        # shared counter to reach the steps taken before it reads them (``Replicas.wait_published``)
        self.remote: dict[int, FlatStore] = {}
        self._by_key: dict[int, Future] = {}
        self._all: list[Future] = []  # every update not yet known to have run (failed ones stay)
        self._claimed: set[int] = set()  # ids of the stores updated this way since take_claimed()
        self._current: list[Future] = []  # the updates of the step in flight (since begin_step)

    def add(self, key: int, store: FlatStore, fut: Future) -> None:
        """``store``'s update of this step runs as ``fut``; the optimizer step must skip the store."""
        self._by_key[key] = fut
        self._claimed.add(id(store))
        # Updates that run on into the next step are never waited for in bulk: drop finished ones here
        self._all = [f for f in self._all if not f.done() or f.exception() is not None]
        self._all.append(fut)
        self._current.append(fut)

    def begin_step(self) -> None:
        """A new step begins: updates added from now on are its own (those of earlier steps may still run)."""
        self._current = []

    def abort_step(self) -> tuple[int, int]:
        """An exception ends the step in flight: its updates not yet started are cancelled, every other one
        is waited for (host sync; their failures are dropped: the step's own exception is the one to see).
        Returns (how many of this step's updates ran, how many updates of any step failed): either means
        the masters and moments no longer are one step's."""
        ran = failed = 0
        for fut in self._current:
            if not fut.cancel():
                failed += fut.exception() is not None  # host wait
                ran += 1
        for fut in self._all:
            if fut not in self._current and not fut.cancelled():
                failed += fut.exception() is not None  # an earlier step's update, running on
        self._all, self._current, self._by_key, self._claimed = [], [], {}, set()
        return ran, failed

    def pending(self) -> bool:
        return bool(self._by_key)

    def wait_for(self, key: int, block: bool = True) -> bool:
        """Whether the update of ``key`` has run; with ``block``, a host wait until it has (and raise what
        it raised). Buffer lifetime: the store's masters may go to the device only after this is True."""
        remote = self.remote.get(key)
        if remote is not None:
            assert remote.published is not None
            if int(remote.published[0]) >= self.replicas.steps:
                return True
            if not block:
                return False
            t0 = time.perf_counter()
            self.replicas.wait_published(remote.published, self.replicas.steps)  # host wait for the owner
            self.stats.update_wait_s += time.perf_counter() - t0
            return True
        fut = self._by_key.get(key)
        if fut is None:
            return True
        if not block and not fut.done():
            return False
        t0 = time.perf_counter()
        fut.result()  # host wait (the host optimizer is the bottleneck here); raises what the update raised
        self.stats.update_wait_s += time.perf_counter() - t0
        del self._by_key[key]
        return True

    def wait_all(self) -> None:
        """Host sync point: every update handed out has run; then the first failure, if any, is raised
        (after all of them have stopped: none still writes a master while the caller handles it)."""
        for key in self.remote:
            self.wait_for(key)  # the updates the node's other ranks run (host wait)
        first: BaseException | None = None
        for fut in self._all:
            exc = None if fut.cancelled() else fut.exception()  # host wait
            first = first or exc
        self._all.clear()
        self._by_key.clear()
        if first is not None:
            raise first

    def take_claimed(self) -> set[int]:
        """Ids of the stores updated (or being updated) since the last call; the caller's optimizer step
        skips them."""
        claimed, self._claimed = self._claimed, set()
        return claimed
