"""The part before the blocks updated on the device, where its gradients are: the next forward need not wait.

The next forward needs the resident part before the blocks (the input embedding, a tied LM head with it)
first, and its gradients are final only when the backward ends. Updated on the host, that part's
device->host gradient copy, host AdamW and host->device copy of the new masters all lie between one step's
backward and the next step's first kernel: at 7B (0.55 B embedding parameters) about 0.2 s of an idle
GPU per step. Here the same AdamW (torch's fused kernel, the step the host would take: same hyperparameters,
same step counts) runs on the device copies, the device copy of the masters stays the weights of the next
forward, and the new masters and moments go home on the device->host stream while it runs.

Buffer lifetimes: ``part.moments`` (device, 2 x the trainable region in fp32: 8 B/param, lasting) holds the
moments the host holds once ``landed`` has fired; it is refreshed from the host whenever the masters may
have changed behind the engine's back (``part.stale`` after a load, a reclaim, an aborted step). The
device copies are rewritten (the next update, a refresh) only after the previous copy home has read them
(``part.landed``). The host masters and moments are written by that copy: the update's future, which every
reader of host state waits for (``UpdateTracker``), completes only once it has landed, and it cannot be
cancelled (an aborted step counts it as run: the copy is queued).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch

from .host_buffers import PinnedRegistry
from .host_worker import HostWorker
from .streams import Streams


class DeviceUpdate:
    """Runs the update of the part before the blocks on the device, when the host optimizer offers one.

    Only while the engine's placement says so (``EngineConfig.resident_on_device``), on one rank (under data
    parallel that part has an owner of its own) and without the gradient path's finiteness check (its flag
    travels with the gradients' copy home).
    """

    def __init__(self, engine: Any) -> None:
        self.streams: Streams = engine.streams
        self.pins: PinnedRegistry = engine.pins
        self.worker: HostWorker = engine.worker
        self.active: Callable[[], bool] = lambda: (engine.config.resident_on_device is True
                                                   and not engine.replicas.parallel and not engine.grads.check_finite)
        self._pinned_ok: dict[int, bool] = {}  # id(store) -> its masters and moments are pinned (asked once)

    def applies(self, part: Any, grads: Sequence[torch.Tensor | None], then: Any) -> bool:
        """Whether ``part`` can be updated here: fp32 host state, every gradient dense in the masters' dtype,
        none held on the host (accumulated micro-batches: the sum is the host's), an update that runs it."""
        store = part.store
        return (
            then is not None and hasattr(then, "on_device") and self.active() and not store.compact
            and part.device is not None and not part.stale
            and all(g is None for g in part.saved_grads)
            and all(g is None for g in grads[store.n_trainable :])
            and any(g is not None for g in grads[: store.n_trainable])
            and all(g is None or (g.dtype == torch.float32 and g.layout == torch.strided and g.is_contiguous()
                                  and g.device == part.device.device) for g in grads)
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
        """Update ``part`` from ``grads`` (its device gradients, layout order) on the compute stream and send
        masters and moments home; returns the future that completes when they have landed."""
        store = part.store
        n = store.train_numel
        compute, d2h = self.streams.compute(), self.streams.d2h
        ea, eas = store.moment_buffers()  # pinned (``applies``)
        if part.moments is None or part.moments.shape[1] != n:  # first use, or the store was laid out again
            part.moments, part.moments_fresh = torch.empty(2, n, device=part.device.device), False
        if part.landed is not None:
            self.streams.wait(compute, part.landed)  # the previous copy home has read what is rewritten now
        if not part.moments_fresh:  # the first update, or the host state changed since the last one
            part.moments[0].copy_(ea, non_blocking=True)
            part.moments[1].copy_(eas, non_blocking=True)
        then.on_device(store, part.device[:n], part.moments[0], part.moments[1], list(grads))  # compute stream
        landed = part.landed = self.streams.event()
        with self.streams.on(d2h):
            self.streams.after_compute(d2h)  # the update has written masters and moments
            store.master[:n].copy_(part.device[:n], non_blocking=True)
            ea.copy_(part.moments[0], non_blocking=True)
            eas.copy_(part.moments[1], non_blocking=True)
            landed.record(d2h)
        part.moments_fresh = True
        part.updated_on_device = True
        fut: Future = Future()
        fut.set_running_or_notify_cancel()  # queued on the device: running, whatever an abort cancels
        self.worker.submit(priority, _complete, landed, fut, store, ready=landed.query)
        return fut


def device_moment_bytes(engine: Any) -> int:
    """Device bytes the moments of the part before the blocks will take once its update runs there (0 where
    it will not): what a placement chosen from steps without them must leave free."""
    part = engine.resident.before
    if part is None or part.store.compact or engine.replicas.parallel:
        return 0
    return 2 * 4 * part.store.train_numel


def _complete(landed: Any, fut: Future, store: Any) -> None:
    """Host worker: the masters and moments are home; readers of the host state may go on."""
    try:
        landed.synchronize()
        store.publish()
        fut.set_result(None)
    except BaseException as exc:  # handed to whoever waits on the future
        fut.set_exception(exc)
