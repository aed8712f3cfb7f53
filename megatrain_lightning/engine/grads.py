"""The gradient path: device slabs -> pinned host memory -> fp32 accumulators or straight into an update.

Per store (a block, or a resident part) and micro-batch, its parameter gradients are packed into one flat
device slab and go to the host in one copy on the device->host stream. Where they land:

* **bf16**, when the block computed in bf16, every parameter has a gradient, none holds one, and they go
  straight into the store's overlapped update (``bf16_grads``): half the bytes, widened in the update.
* **the fp32 accumulator** directly, when it holds nothing that must be kept (the first micro-batch);
  a store with nothing to accumulate and an overlapped update borrows a pooled buffer for it instead of
  keeping its own (``grad_buffers``).
* **pinned staging**, otherwise: the host worker adds it into the accumulator once the copy has landed.

Buffer lifetimes: device slab ``k`` is rewritten only after its last device->host copy has run (event
``slab_done[k]``); a staging buffer only after the worker consumed it (its future); a lent buffer goes
back to the pool when the update that read it is done. The one host sync is :meth:`GradPath.drain`.
"""

from __future__ import annotations

import queue
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch

from .host_worker import HostWorker
from .replicas import Replicas
from .stats import EngineStats
from .host_buffers import PinnedRegistry
from .store import FlatStore
from .streams import Streams

# The update run on the host worker once a store's gradients are final (the host optimizer's). If it has a
# ``prefers_half_grads()`` method, ``bf16_grads=None`` asks it, once, whether bf16 gradients are worth it.
Update = Callable[[FlatStore], None]


class GradPath:
    """Ships each store's gradients home and hands them to the host worker."""

    def __init__(
        self,
        streams: Streams,
        numel: int,
        pins: PinnedRegistry,
        stats: EngineStats,
        worker: HostWorker,
        pool_buffers: int = 0,
        pool_numel: int = 0,
        half: bool | None = False,
        check_finite: bool = False,
        replicas: Replicas | None = None,
    ) -> None:
        self.streams = streams
        self.numel = numel
        self.pins = pins
        self.stats = stats
        self.worker = worker
        # bf16 gradients bound for an update travel as bf16; None: decided at the first one (see _wants_half)
        self.half = half
        # Two fp32 device slabs: block i's slab is overwritten by block i+2 only after its copy has run.
        self.slabs = [torch.empty(numel, device=streams.device) for _ in range(2)]
        self.slab_done = [streams.event() for _ in range(2)]
        self.slab_written = [streams.event() for _ in range(2)]
        self.turn = 0
        # Pinned staging for accumulation, allocated on first need; each has the future of its last use.
        self.staging: list[torch.Tensor] = []
        self.staging_busy: list[Future | None] = []
        self.staging_turn = 0
        self._staged = 0  # the staging buffer taken last
        self.busy: dict[int, Future] = {}  # id(store) -> its accumulation job still to run
        self.pending: list[Future] = []  # accumulation jobs of this backward
        # Pooled buffers: lent from a store's device->host copy to the end of its update on the worker.
        self.pool_buffers = pool_buffers
        self.pool_numel = pool_numel
        self.pool_free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self.pool_made = 0
        self._pool_all: list[torch.Tensor] = []
        self._lent_to: dict[int, tuple[FlatStore, torch.Tensor]] = {}  # id(store) -> the buffer it holds
        # check_finite: each store's gradients are checked on the device before they leave, and its early
        # update refuses non-finite ones (a flag in pinned memory that lands with the copy)
        self.check_finite = check_finite
        self._finite: dict[int, torch.Tensor] = {}  # id(store) -> its pinned flag
        self.window_finite: torch.Tensor | None = None  # device: all gradients since the last reset finite
        self.replicas = replicas or Replicas()
        # The event of the last gradient copy (or reduction) queued on the device->host stream: what
        # ``drain`` waits for. Not the stream itself: the device updates' copies of masters and moments home
        # (device_update.py) queue there after the backward's last gradient, and nothing at the step's end
        # reads them (their futures say when they have landed).
        self.last_copy: Any = None

    def send(self, store: FlatStore, grads: Sequence[torch.Tensor | None], then: Update | None = None,
             priority: int = 0, owner: bool = True) -> Future | None:
        """Ship one store's gradients (layout order, ``None`` where a parameter got none) to the host.

        ``then(store)`` runs on the host worker once they are in host memory (the overlapped optimizer
        update of that store); its future is returned. ``priority``: the store's place in the next forward
        (see ``host_worker.py``). Data parallel: the slab is averaged over the ranks first, and only the
        store's ``owner`` copies it home (the others' part ends with the reduction).
        """
        n = store.train_numel  # the trainable region: frozen parameters have no gradient
        self._adopt_foreign(store)
        k = self.turn
        self.turn ^= 1
        assert all(g is None for g in grads[store.n_trainable :]), "a frozen parameter got a gradient"
        grads = grads[: store.n_trainable]
        trainable = store.trainable
        empty = all(p.grad is None for p in trainable)
        wide = set(store.layout.wide)
        half = (
            then is not None and empty and not self.adding(store) and store.can_hold_half()
            and all(g is not None and (g.dtype == torch.bfloat16 or (i in wide and g.dtype == torch.float32))
                    for i, g in enumerate(grads))
            and self._wants_half(then)
        )
        # The slabs are fp32. A bf16 store's gradients use the first half of one's bytes; the fp32 gradients
        # of its one-dimensional weights (fp32 on the device, engine/slots.py) follow at half_wide_offset.
        if half:
            h = store.half_wide_offset()
            slab = self.slabs[k][: h + store.layout.wide_numel]
            parts = [slab.view(torch.bfloat16)[:n], slab[h:]]  # as what they hold, for the finiteness check
            wide_views = store.wide_train_views(parts[1])
            views = [wide_views.get(i, v) for i, v in enumerate(store.train_views(parts[0]))]
        else:
            slab = self.slabs[k][:n]
            parts = [slab]
            views = store.train_views(slab)
        compute = self.streams.compute()
        self.streams.wait(compute, self.slab_done[k])  # slab lifetime: its previous copy out has run
        slab.zero_()  # padding and absent gradients must read as zeros on the host
        present = [(v, g) for v, g in zip(views, grads) if g is not None]
        if present:
            torch._foreach_copy_([v for v, _ in present], [g for _, g in present])  # casts bf16 -> fp32 (not if half)
        self.slab_written[k].record(compute)
        if self.replicas.parallel:
            with self.streams.on(self.streams.d2h):  # the reduction, and the copy after it, on the d2h stream
                self.streams.wait(self.streams.d2h, self.slab_written[k])
                self.replicas.average(slab)  # the gradients of every rank's micro-batch, averaged
                reduced = self.slab_written[k] = self.streams.record_on(self.streams.d2h)
            if not owner:  # slab lifetime: free once the reduction has read it
                self.slab_done[k] = self.last_copy = reduced
                return None

        lent = self._lend(store, half) if then is not None and store.grad is None and empty else None
        if half:
            target = store.hold_half_grad(lent)
            direct = True
            self.stats.half_sent += 1
        else:
            host = store.grad_buffer()
            direct = empty and not self.adding(store)  # straight in only when nothing there must be kept
            target = host[:n] if direct else self._take_staging(n)
        fresh = [g is not None and p.grad is None for p, g in zip(trainable, grads)]
        held = [p.grad is not None for p in trainable]
        assert lent is None or direct  # a lent buffer holds nothing yet: its store's copy lands straight in it
        # One event per copy: the worker must wait for *this* copy, not a later reuse of the slab.
        flag = None
        if self.check_finite:
            finite = torch.stack([torch.isfinite(p).all() for p in parts]).all().reshape(1)  # on the device, after the packing
            if self.window_finite is None:
                self.window_finite = torch.ones(1, dtype=torch.bool, device=self.streams.device)
            self.window_finite.logical_and_(finite)
            if then is not None:  # the store's early update checks its own flag
                flag = self._finite.setdefault(id(store), self.pins.empty(1, torch.bool))
        done = self.slab_done[k] = self.streams.event()
        with self.streams.on(self.streams.d2h):
            self.streams.wait(self.streams.d2h, self.slab_written[k])
            target.copy_(slab, non_blocking=True)
            if flag is not None:
                flag.copy_(finite, non_blocking=True)
                if self.streams.cuda:
                    finite.record_stream(self.streams.d2h)
            done.record(self.streams.d2h)
        self.last_copy = done
        if not half:
            # Attach before the worker may look: the overlapped update reads ``p.grad``.
            for p, view, f in zip(trainable, store.grad_views, fresh):
                if f:
                    p.grad = view
        if not direct:
            fut = self.worker.submit(priority, _accumulate, done, store, target, fresh, held, ready=done.query)
            self.staging_busy[self._staged] = fut
            self.busy[id(store)] = fut
            self.pending.append(fut)
            if then is None:
                return None
            # a job of its own, so that draining the gradients does not wait for the update
            return self.worker.submit(priority, _update_and_publish, then, store, ready=fut.done)
        if then is None:
            return None
        if lent is not None:
            self._lent_to[id(store)] = (store, lent)
        return self.worker.submit(priority, self._after_copy, done, store, then, lent, half, flag, ready=done.query)

    def _after_copy(self, done: Any, store: FlatStore, then: Update, lent: torch.Tensor | None, half: bool,
                    flag: torch.Tensor | None) -> None:
        """Host worker: the update, once the device->host copy into the accumulator has landed."""
        done.synchronize()
        try:
            if flag is not None and not bool(flag[0]):
                raise FloatingPointError(
                    f"non-finite gradients in a store of {store.numel:,} parameters although the loss was finite; "
                    "its update is refused (the step is stopped)")
            then(store)
            store.publish()  # data parallel: the node's other ranks may read this store now
        finally:
            # Buffer lifetime: the update has read the gradients; bf16 ones are let go, a lent buffer goes back.
            self._give_back(store, lent, half)

    def _give_back(self, store: FlatStore, lent: torch.Tensor | None, half: bool) -> None:
        if half:
            store.drop_half_grad()
        elif lent is not None:
            store.return_grad()
        if lent is not None:
            self._lent_to.pop(id(store), None)
            self.pool_free.put(lent)

    def gradients_finite(self) -> bool:
        """Whether every gradient sent since the last call was finite (a host sync on one device scalar);
        resets the record. True when nothing was checked."""
        flag, self.window_finite = self.window_finite, None
        return True if flag is None else bool(flag.item())

    def abort(self) -> None:
        """After an aborted step (its updates cancelled): buffers lent to updates that never ran go back,
        bf16 gradients held for them are let go, accumulation jobs are waited for (errors dropped)."""
        if self.streams.cuda:
            self.streams.d2h.synchronize()
        for fut in self.pending:
            if not fut.cancel():
                fut.exception()
        self.pending.clear()
        self.busy.clear()
        for store, lent in list(self._lent_to.values()):
            self._give_back(store, lent, store.half_grad is not None)

    def _adopt_foreign(self, store: FlatStore) -> None:
        """A ``.grad`` that is not the store's view (autograd put it there: the model used the parameter
        outside its block too) is copied into the accumulator, which becomes its ``.grad``, so that the
        block's share is added to it, not beside it."""
        for i, p in enumerate(store.trainable):
            g = p.grad
            if g is None or (store.grad is not None and g is store.grad_views[i]):
                continue
            fut = self.busy.get(id(store))
            if fut is not None:
                fut.result()  # host wait: no add into the accumulator may run meanwhile
            store.grad_buffer()
            with torch.no_grad():
                store.grad_views[i].copy_(g)
            p.grad = store.grad_views[i]

    def _wants_half(self, then: Update) -> bool:
        if self.half is None:  # decided once: an fp32 run never asks (and never builds a kernel)
            prefers = getattr(then, "prefers_half_grads", None)
            self.half = bool(prefers()) if prefers is not None else False
        return self.half

    def _lend(self, store: FlatStore, half: bool) -> torch.Tensor | None:
        """A pooled buffer for ``store``'s gradients, or None (no pool, or the store is larger). With
        ``half`` the caller reads it as bf16 (``FlatStore.hold_half_grad``), else it becomes ``store.grad``."""
        if self.pool_buffers == 0 or store.train_numel > self.pool_numel:
            return None
        try:
            buf = self.pool_free.get_nowait()
        except queue.Empty:
            if self.pool_made < self.pool_buffers:
                buf = self.pins.empty(self.pool_numel)
                self._pool_all.append(buf)
                self.pool_made += 1
            else:
                # Host wait: every buffer is lent to a queued update; the worker returns one when an update
                # is done (the device runs ahead by `pool_buffers` blocks at most).
                buf = self.pool_free.get()
        if not half:
            store.lend_grad(buf)
        self.stats.grads_lent += 1
        return buf

    def adding(self, store: FlatStore) -> bool:
        """Whether an accumulation job of ``store``'s gradients is still to run on the host worker."""
        fut = self.busy.get(id(store))
        return fut is not None and not fut.done()

    def _take_staging(self, n: int) -> torch.Tensor:
        if not self.staging:
            self.staging = [self.pins.empty(self.numel) for _ in range(2)]
            self.staging_busy = [None, None]
        j = self._staged = self.staging_turn
        self.staging_turn ^= 1
        busy = self.staging_busy[j]
        if busy is not None:
            busy.result()  # host wait: the worker must have consumed this staging buffer
        return self.staging[j][:n]

    def fit(self, numel: int, pool_numel: int) -> None:
        """Grow the slabs, the staging and the pool to stores laid out again (more trainable elements);
        between steps only (no copy in flight: the last drain ran)."""
        if numel > self.numel:
            self.numel = numel
            self.slabs = [torch.empty(numel, device=self.streams.device) for _ in range(2)]
            self.slab_done = [self.streams.event() for _ in range(2)]
            self.pins.release(self.staging)
            self.staging, self.staging_busy = [], []
        if pool_numel > self.pool_numel:
            self.pool_numel = pool_numel
            self.pins.release(self._pool_all)  # lent to nothing between steps: too small now
            self.pool_free, self._pool_all, self.pool_made = queue.SimpleQueue(), [], 0

    def drain(self) -> None:
        """Host sync point: every gradient of this backward is in its fp32 accumulator after this.

        Waits for the last gradient copy (and what the device->host stream ran before it), not for the
        copies home that device updates queued after it: until 2026-12-04 a whole-stream synchronize here held
        the step's end for the embedding's masters and moments (12 B/param: 70 ms at 3B, 140 ms for GPT-OSS-20B)."""
        if self.last_copy is not None:
            self.last_copy.synchronize()
            self.last_copy = None
        try:
            for fut in self.pending:
                fut.result()
        finally:
            self.pending.clear()
            self.busy.clear()

    def close(self) -> None:
        self.drain()
        self.slabs = []


def _update_and_publish(then: Update, store: FlatStore) -> None:
    """Host worker: the update of a store whose gradients were added in first."""
    then(store)
    store.publish()  # data parallel: the node's other ranks may read this store now


def _accumulate(done: Any, store: FlatStore, staged: torch.Tensor, fresh: list[bool], held: list[bool]) -> None:
    """Host worker: add (or, for parameters whose ``.grad`` was None, copy) a staged gradient."""
    done.synchronize()  # the worker waits for the device->host copy, the thread feeding the device does not
    assert store.grad is not None
    if not any(fresh):
        store.grad[: staged.numel()].add_(staged)  # one flat add; absent gradients are zeros
    else:
        for view, src, f, h in zip(store.grad_views, store.train_views(staged), fresh, held):
            if f:
                view.copy_(src)
            elif h:
                view.add_(src)
