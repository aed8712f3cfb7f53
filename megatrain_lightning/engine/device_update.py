"""The updates the next forward waits for first, run on the device where their gradients are.

The next forward needs the resident part before the blocks (the input embedding, a tied LM head with it)
and then the first block first, and the backward finishes their gradients last. Updated on the host, their
device->host gradient copy, host AdamW and host->device copy of the new masters all lie between one step's
backward and the next step's first kernel: at 7B about 0.2 s (the embedding's 0.55 B parameters) and
0.14 s (the first block's 0.23 B) of an idle GPU per step. Here the same AdamW (torch's fused kernel, the
step the host would take: same hyperparameters, same step counts) runs on device copies of their masters
and moments, and the new weights are the next forward's (the resident part's fp32 copy; the first block's
slot, cast as a copy from the host would be). Cached blocks can be updated here too (``device_blocks``):
each takes its AdamW off the host, for runs that the host AdamW bounds; their new weights stay in their
fixed slots.

Home on demand: in a step whose updates may run on into the next one (``hold``: nothing reads the host
state between the steps), the device holds the newer masters and moments of what it updates (``behind``:
the host's are a step or more older) and sends them home only when something reads the host state: the
engine's ``settle()`` (checkpoints, evaluation, hooks between steps, the end of fit), a host update of the
same store (``home``), an aborted step. A streamed block (the first, not cached) whose slot is refilled before
its next backward is cast from those device masters (``ahead``): until 2026-12-05 its masters went home every
step and came back for that (a Qwen3-30B-A3B layer: 2.49 GB each way on the link per step; speed not yet
measured). In other steps each update's masters and moments go home as soon as it has run, beside the
rest of the backward. Until 2026-12-04 they always did: 12 B/param on the device->host link, for GPT-OSS-20B
cut to 7 layers 47 GB per step, the step's bottleneck.

Buffer lifetimes: the device moments (2 x the trainable region in fp32: 8 B/param) and, for a block, its
fp32 masters (4 B/param) last; they hold what the host holds, or newer (``behind``), once refreshed, and
are refreshed from the host whenever the masters may have changed behind the engine's back (``stale``
after a load, a reclaim, an aborted step: each comes after ``home``). They are rewritten (the next update,
a refresh) only after the previous copy home has read them (``landed``); a slot refilled from a block's
masters (``ahead``, host->device stream) reads them once their update's future has completed, and the block's
next update comes after the backward that waited for that slot. The update's future completes
once its kernels have run (the gradients are read) and what it sends home has landed;
it cannot be cancelled (an aborted step counts it as run). A block's fp32 gradients (4 B/param, when it
computes in bf16) live from its backward to the update's last kernel.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .host_buffers import PinnedRegistry
from .host_worker import HostWorker
from .streams import Streams


@dataclass
class BlockOnDevice:
    """A block's lasting device state for its update there (a resident part keeps the same fields)."""

    block: int
    master: torch.Tensor  # fp32, the trainable region
    moments: torch.Tensor | None = None
    moments_fresh: bool = False  # master and moments are the host's
    landed: Any = None
    updated_on_device: bool = False


class DeviceUpdate:
    """Runs the updates of the part before the blocks and of :func:`device_blocks` on the device, when the
    host optimizer offers one.

    Only while the engine's placement says so (``EngineConfig.update_on_device``), on one rank (under data
    parallel each store has an owner of its own) and without the gradient path's finiteness check (its flag
    travels with the gradients' copy home).
    """

    def __init__(self, engine: Any) -> None:
        self.streams: Streams = engine.streams
        self.pins: PinnedRegistry = engine.pins
        self.worker: HostWorker = engine.worker
        self.engine = engine
        self.blocks: dict[int, BlockOnDevice] = {}  # the blocks updated here so far, by index
        self.active: Callable[[], bool] = lambda: (bool(engine.config.update_on_device)
                                                   and not engine.replicas.parallel and not engine.grads.check_finite)
        self._pinned_ok: dict[int, bool] = {}  # id(store) -> its masters and moments are pinned (asked once)
        # id(store) -> (store, device masters, holder): the stores whose newer masters and moments are on the
        # device only (see the module's "home on demand"); emptied by ``home``
        self.behind: dict[int, tuple[Any, torch.Tensor, Any]] = {}
        # Whether this step's updates may stay on the device (``StreamingEngine.hold_updates``): only when the
        # step's end will not read the host state anyway. Otherwise each update's masters and moments go home
        # as soon as it has run, overlapping the rest of the backward instead of the step's end waiting for all.
        self.hold = False

    def applies(self, part: Any, grads: Sequence[torch.Tensor | None], then: Any) -> bool:
        """Whether ``part`` can be updated here: fp32 host state, every gradient dense in the masters' dtype,
        none held on the host (accumulated micro-batches: the sum is the host's), an update that runs it."""
        return (part.device is not None and not part.stale and all(g is None for g in part.saved_grads)
                and all(g is None or (g.dtype == torch.float32 and g.is_contiguous()) for g in grads)
                and self._can(part.store, grads, then))

    def applies_block(self, block: int, grads: Sequence[torch.Tensor | None], then: Any) -> bool:
        """Whether ``block``'s final gradients can update it here: it is one of :func:`device_blocks`,
        nothing of its gradient is held or being added on the host, and its weights are in a slot."""
        engine = self.engine
        store = engine.stores[block]
        return (block in device_blocks(engine) and store.half_grad is None
                and all(p.grad is None for p in store.trainable) and not engine.grads.adding(store)
                and engine.weights.slots.slot_of(block) is not None and self._can(store, grads, then))

    def _can(self, store: Any, grads: Sequence[torch.Tensor | None], then: Any) -> bool:
        """The conditions both share: an update that runs here, fp32 host state, dense device gradients
        of the trainable parameters only, the host buffers the copies home land in pinned."""
        device = self.streams.device
        return (
            then is not None and hasattr(then, "on_device") and self.active() and not store.compact
            and all(g is None for g in grads[store.n_trainable :])
            and any(g is not None for g in grads[: store.n_trainable])
            and all(g is None or (g.layout == torch.strided and g.device.type == device.type) for g in grads)
            and self._pinned(store)
        )

    def _pinned(self, store: Any) -> bool:
        """Whether the copies home can be queued: masters and moments pinned (the moments are pinned in
        place here, once). A copy into pageable memory would hold the host until the backward is done."""
        if not self.streams.cuda:
            return True
        if id(store) in self._pinned_ok:
            return self._pinned_ok[id(store)]
        ea, eas = store.moment_buffers()
        for t in (ea, eas):
            if not t.is_pinned():
                self.pins.register(t)
        ok = self._pinned_ok[id(store)] = all(t.is_pinned() for t in (store.master, ea, eas))
        return ok

    def run(self, part: Any, grads: Sequence[torch.Tensor | None], then: Any, priority: int) -> Future:
        """Update resident ``part`` from ``grads`` (its device gradients, layout order) on the compute stream
        and send masters and moments home; returns the future that completes when they have landed."""
        n = part.store.train_numel
        return self._update(part.store, part.device[:n], part, list(grads), then, priority)

    def run_block(self, block: int, grads: Sequence[torch.Tensor | None], then: Any) -> Future:
        """The same for a block: its fp32 gradients from ``grads``, its new weights into the slot the
        backward read them from (``WeightStream.refresh``), masters and moments home."""
        store = self.engine.stores[block]
        n = store.train_numel
        held = self.blocks.get(block)
        if held is None or held.master.numel() != n:  # its first update here, or its store was laid out again
            held = self.blocks[block] = BlockOnDevice(block, torch.empty(n, device=self.streams.device))
        # buffer lifetime: allocated on the compute stream, freed once the update's kernels are queued
        g32 = [g if g is None or g.dtype == torch.float32 else g.float() for g in grads]
        fut = self._update(store, held.master, held, g32, then, block, own_master=True)
        self.engine.weights.refresh(block, held.master)
        return fut

    def _update(self, store: Any, master: torch.Tensor, holder: Any, grads: list[torch.Tensor | None], then: Any,
                priority: int, own_master: bool = False) -> Future:
        """The update of ``store``'s device ``master`` and ``holder.moments`` (compute stream); then, unless
        the step holds them (``hold``), the copy of both home (device->host stream); the future completes once
        what goes home has landed (else once the update's kernels have run). ``own_master``: the device masters
        are the holder's own (a block's), refreshed from the host with the moments (a resident part's are its
        device copy, refreshed by ``ResidentParts.ensure``)."""
        n = store.train_numel
        compute, d2h = self.streams.compute(), self.streams.d2h
        ea, eas = store.moment_buffers()  # pinned (``_can``)
        if holder.moments is None or holder.moments.shape[1] != n:  # first use, or the store was laid out again
            holder.moments, holder.moments_fresh = torch.empty(2, n, device=master.device), False
        if holder.landed is not None:
            self.streams.wait(compute, holder.landed)  # the previous copy home has read what is rewritten now
        if not holder.moments_fresh:  # the first update, or the host state changed since the last one
            if own_master:
                master.copy_(store.master[:n], non_blocking=True)  # pinned (``_pinned``)
            holder.moments[0].copy_(ea, non_blocking=True)
            holder.moments[1].copy_(eas, non_blocking=True)
        then.on_device(store, master, holder.moments[0], holder.moments[1], grads)  # compute stream
        if self.hold:
            # Held here: a streamed block's slot, refilled before its next backward, is cast from these
            # device masters (``ahead``, read by ``WeightStream``), not from the host's older ones.
            self.behind[id(store)] = (store, master, holder)
            landed = self.streams.record_on(compute)  # the update's kernels have read the gradients
        else:
            self.behind.pop(id(store), None)  # held by an earlier step: the copy below sends the newest home
            landed = holder.landed = self.streams.event()
            self.streams.after_compute(d2h)  # the update has written them (asked outside ``on(d2h)``)
            with self.streams.on(d2h):
                store.master[:n].copy_(master, non_blocking=True)
                ea.copy_(holder.moments[0], non_blocking=True)
                eas.copy_(holder.moments[1], non_blocking=True)
                landed.record(d2h)
        holder.moments_fresh = True
        holder.updated_on_device = True
        fut: Future = Future()
        fut.set_running_or_notify_cancel()  # queued on the device: running, whatever an abort cancels
        self.worker.submit(priority, _complete, landed, fut, store, ready=landed.query)
        return fut

    def ahead(self, block: int) -> torch.Tensor | None:
        """``block``'s fp32 masters on the device (its trainable region) where they are newer than the host's
        (held: ``behind``), else None. A slot refilled with the block then casts them (``WeightStream``)."""
        held = self.blocks.get(block)
        if held is None or id(self.engine.stores[block]) not in self.behind:
            return None
        return held.master

    def home(self, keep: set[int] | None = None, only: Any = None) -> None:
        """Host sync point: the masters and moments the device holds ahead of the host (``behind``) go home:
        all of them, or all but the stores whose ids are in ``keep`` (updated here this step), or ``only``
        that store. Every reader or host writer of those stores' masters and moments calls it first
        (``StreamingEngine.settle``, a host update of such a store)."""
        if not self.behind or (only is not None and id(only) not in self.behind):
            return  # the common case, every store's every step: nothing held, or not this store
        keep = keep or set()
        todo = [(k, v) for k, v in self.behind.items()
                if k not in keep and (only is None or k == id(only))]
        if not todo:
            return
        d2h = self.streams.d2h
        self.streams.after_compute(d2h)  # every update queued so far has written them
        with self.streams.on(d2h):
            for _, (store, master, holder) in todo:
                n = store.train_numel
                ea, eas = store.moment_buffers()
                store.master[:n].copy_(master, non_blocking=True)
                ea.copy_(holder.moments[0], non_blocking=True)
                eas.copy_(holder.moments[1], non_blocking=True)
            landed = self.streams.record_on(d2h)
        for key, (_, _, holder) in todo:
            holder.landed = landed  # buffer lifetime: nothing rewrites them before this copy has read them
            del self.behind[key]
        landed.synchronize()  # host wait: the host state is whole again

    def home_after_abort(self) -> bool:
        """An exception ended the step: what the device updated goes home (its updates count as run). False
        where that failed (a broken device): the host state is then not one step's, and nothing is held."""
        try:
            self.home()
            return True
        except Exception:  # noqa: BLE001  (the step's own exception is the one to see)
            self.behind = {}
            return False

    def release(self) -> None:
        """The placement changes (``placement.replace``, after the engine settled): the device state of the
        updates here goes back to the device; whatever runs here next is refreshed from the host."""
        assert not self.behind, "release() before home(): the device holds state the host has not"
        self.blocks = {}
        for part in self.engine.resident.parts:
            part.moments, part.moments_fresh = None, False

    def stale(self) -> None:
        """The masters changed (see ``ResidentParts.stale``): the blocks' device state is out of date, but
        for the first such call after their update on the device. Whatever changed the host state came after
        ``home`` (settle, a host update, an abort all call it): a store still behind would lose that change."""
        for held in self.blocks.values():
            if held.updated_on_device:
                held.updated_on_device = False
            else:
                self._not_behind(self.engine.stores[held.block])
                held.moments_fresh = False
        for part in self.engine.resident.parts:
            if not part.updated_on_device:
                self._not_behind(part.store)

    def _not_behind(self, store: Any) -> None:
        if id(store) in self.behind:
            raise RuntimeError(
                "internal error: the host masters of a store updated on the device changed before its newer "
                "state was sent home (device_update.home); please report it with the run's configuration")


def device_blocks(engine: Any) -> list[int]:
    """The blocks ``EngineConfig.update_on_device`` updates on the device, in forward order: the next
    forward's first block (the slot the backward read last keeps its new weights), then up to N - 1 cached
    blocks (their fixed slots keep them). No other streamed block: its slot is refilled before the next
    forward needs it (from its device masters, 12 B/param of device memory that a cached block puts to more
    use)."""
    order = list(dict.fromkeys(engine.weights.recorded or range(len(engine.stores))))
    return engine.config.device_updated(order, engine.weights.slots.fixed)


def device_moment_bytes(engine: Any, blocks: int = 1) -> int:
    """Device bytes the updates on the device keep once they run there, with ``blocks`` blocks (0 where they
    will not): the moments of the part before the blocks, each block's fp32 masters and moments and one
    block's fp32 gradients while they live. What a placement chosen from steps without them must leave free."""
    if engine.replicas.parallel or blocks == 0:
        return 0
    part = engine.resident.before
    before = 0 if part is None or part.store.compact else 8 * part.store.train_numel
    order = list(dict.fromkeys(engine.weights.recorded or range(len(engine.stores))))
    sizes = [engine.stores[b].train_numel for b in order[:blocks] if not engine.stores[b].compact]
    return before + 12 * sum(sizes) + 4 * max(sizes, default=0)


def _complete(landed: Any, fut: Future, store: Any) -> None:
    """Host worker: the masters and moments are home; readers of the host state may go on."""
    try:
        landed.synchronize()
        store.publish()
        fut.set_result(None)
    except BaseException as exc:  # handed to whoever waits on the future
        fut.set_exception(exc)
