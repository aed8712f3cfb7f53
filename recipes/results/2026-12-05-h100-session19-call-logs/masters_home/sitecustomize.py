# Prepared in session 19 for the next session's call: with this directory first on PYTHONPATH, a streamed first
# block updated on the device sends its masters home every step and its slot is refilled from the host (the
# behaviour before commit fed151e), for a side-by-side measurement only. _update is commit 3ce1f4b's
# DeviceUpdate._update.
from concurrent.futures import Future
from typing import Any

import torch

from megatrain_lightning.engine.device_update import DeviceUpdate, _complete


def _update(self, store: Any, master: torch.Tensor, holder: Any, grads: list[torch.Tensor | None], then: Any,
            priority: int, own_master: bool = False) -> Future:
    """The update of ``store``'s device ``master`` and ``holder.moments`` (compute stream); then, unless
    the step holds them (``hold``), the copy of both home (device->host stream), and a streamed block's
    masters in any case; the future completes once what goes home has landed (else once the update's
    kernels have run). ``own_master``: the device masters are the holder's own (a block's), refreshed from
    the host with the moments (a resident part's are its device copy, refreshed by ``ResidentParts.ensure``)."""
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
    streamed = own_master and holder.block not in self.engine.weights.slots.fixed
    if self.hold:
        self.behind[id(store)] = (store, master, holder)
    else:
        self.behind.pop(id(store), None)  # held by an earlier step: the copy below sends the newest home
    if streamed or not self.hold:
        # Masters home now: a streamed block's recompute and backward in the next step load its weights
        # from the host masters (whose update future they wait for); moments too unless the step holds them.
        landed = holder.landed = self.streams.event()
        self.streams.after_compute(d2h)  # the update has written them (asked outside ``on(d2h)``)
        with self.streams.on(d2h):
            store.master[:n].copy_(master, non_blocking=True)
            if not self.hold:
                ea.copy_(holder.moments[0], non_blocking=True)
                eas.copy_(holder.moments[1], non_blocking=True)
            landed.record(d2h)
    else:
        landed = self.streams.record_on(compute)  # the update's kernels have read the gradients
    holder.moments_fresh = True
    holder.updated_on_device = True
    fut: Future = Future()
    fut.set_running_or_notify_cancel()  # queued on the device: running, whatever an abort cancels
    self.worker.submit(priority, _complete, landed, fut, store, ready=landed.query)
    return fut


DeviceUpdate._update = _update
DeviceUpdate.ahead = lambda self, block: None
