"""Saved block inputs: parked in pinned host memory (``offload_inputs``) or kept narrow on the device
(``saved_inputs_dtype="compute"``), and brought back one block ahead of their backward.

A recomputed block saves only its inputs; the large one is the residual stream (tokens x hidden x 4 B).

* Offloaded (the first ``offload_inputs`` blocks): it goes to the host on the device->host stream right
  after the block's forward and comes back on the host->device stream while the backward of the block
  after it runs. The first blocks are the ones to offload: their backward comes last, so their copies
  have the longest time to run, and the last blocks, whose backward comes first, need no copy back at
  the very start of the backward. The first block kept on the device still parks its input here (as
  is, no copy), so that its backward can start bringing back the last offloaded one.
* Narrow (``saved_inputs_dtype="compute"``): the saved copy is cast to the compute dtype (bf16 under
  bf16-mixed) on the compute stream before it is kept or sent, and cast back to its own dtype when it
  comes back. Half the bytes on the device, on the link and in pinned memory; the recompute then starts
  from the rounded input (not exact: docs/long_context.md measures it).

Buffer lifetimes: an offloaded device tensor (the input itself, or its narrow copy) is recorded on the
device->host stream, so the caching allocator reuses its memory only after the copy has run; the fetched
copy is recorded on compute. A parked tensor is dropped as soon as its block's backward takes it back
(``unstash``); the rest of a micro-batch's stashes at ``reset``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .host_buffers import PinnedRegistry
from .streams import Streams


class Stash:
    """The saved inputs of one recomputed block call: the ones autograd keeps (``tensors``) and the
    parked ones (``parked``: pinned host copies while offloaded, else device tensors, narrowed or not)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors: list[torch.Tensor | None] = list(tensors)  # None where parked
        self.parked: dict[int, torch.Tensor] = {}
        self.dtypes: dict[int, torch.dtype] = {}  # what each parked input comes back as
        self.versions: dict[int, int] = {}  # parked as is (no copy): its version at the forward
        self.on_host = False
        self.device: dict[int, torch.Tensor] = {}  # fetched copies of host-parked inputs
        self.offloaded: Any = None  # event: the copies to the host have run
        self.fetched: Any = None  # event: the copies back have run
        self.index = -1  # position in InputOffload.stashes (host-parked ones only)
        self.ahead = -1  # the host-parked stash of the call just before this one (fetched during its backward)
        self.released = False

    @property
    def host(self) -> dict[int, torch.Tensor]:
        """The parked inputs (block.py keeps the stash instead of saving the tensors when there are any).
        Named for the offloaded case; with ``saved_inputs_dtype="compute"`` they may be on the device."""
        return self.parked

    def release(self) -> None:
        self.parked, self.device, self.released = {}, {}, True


class InputOffload:
    """Saved inputs of the current micro-batch's recomputed block calls.

    Args:
        offloaded: blocks ``0 .. offloaded-1`` park their saved inputs on the host
            (:meth:`EngineConfig.offloaded_blocks`).
        narrow: the dtype saved inputs are stored in (the compute dtype), or None to keep theirs.
    """

    def __init__(self, streams: Streams, pins: PinnedRegistry, offloaded: int, narrow: torch.dtype | None = None) -> None:
        self.streams = streams
        self.pins = pins
        self.offloaded = offloaded
        self.narrow = narrow
        self.stashes: list[Stash] = []  # host-parked stashes, in forward order
        self._last_host = -1  # index in `stashes` if the previous call's stash went to the host, else -1

    @property
    def enabled(self) -> bool:
        return self.offloaded > 0

    def _narrows(self, t: torch.Tensor) -> bool:
        return self.narrow is not None and t.dtype.itemsize > self.narrow.itemsize

    def stash(self, tensors: Sequence[torch.Tensor], streaming: bool, block: int) -> Stash:
        """Saved inputs of a recomputed call of ``block``. Parked: the floating tensors that require grad
        (position tables and masks are shared by every block and stay with autograd)."""
        stash = Stash(list(tensors))
        if not streaming:
            return stash
        device = self.streams.device
        targets = [i for i, t in enumerate(tensors)
                   if t.is_floating_point() and t.requires_grad and t.device == device]
        to_host = block < self.offloaded
        ahead, self._last_host = self._last_host, -1
        if not targets or not (to_host or ahead >= 0 or any(self._narrows(tensors[i]) for i in targets)):
            return stash  # autograd saves them, as without this module
        for i in targets:
            t = tensors[i]
            stash.dtypes[i] = t.dtype
            if self._narrows(t):
                # a new device buffer on compute, kept until this block's backward (or until its copy
                # to the host has run); the wide input is freed once the caller drops it
                stash.parked[i] = t.detach().to(self.narrow)
            else:
                stash.parked[i] = t.detach()  # the input itself: an in-place change would go unseen
                stash.versions[i] = t._version
            stash.tensors[i] = None
        stash.ahead = ahead
        if to_host:
            self._send(stash)
        return stash

    def _send(self, stash: Stash) -> None:
        compute, d2h = self.streams.compute(), self.streams.d2h
        produced = self.streams.record_on(compute)
        with self.streams.on(d2h):
            self.streams.wait(d2h, produced)
            for i, t in list(stash.parked.items()):
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pins.enabled)
                host.copy_(t, non_blocking=True)
                if self.streams.cuda:
                    t.record_stream(d2h)  # buffer lifetime: freed only after this copy has run
                stash.parked[i] = host
        stash.versions = {}  # the host copy is taken now: later changes to the input cannot reach it
        stash.offloaded = self.streams.record_on(d2h)
        stash.on_host = True
        stash.index = self._last_host = len(self.stashes)
        self.stashes.append(stash)

    def unstash(self, stash: Stash) -> list[torch.Tensor]:
        """The saved inputs back on the device in their own dtype (a device-side wait); the next stash in
        backward order starts coming back now."""
        self._fetch(stash)
        if stash.ahead >= 0:
            self._fetch(self.stashes[stash.ahead])  # backward runs in reverse: prefetch one ahead
        if stash.fetched is not None:
            compute = self.streams.compute()
            self.streams.wait(compute, stash.fetched)
            if self.streams.cuda:
                for t in stash.device.values():
                    t.record_stream(compute)
        out: list[torch.Tensor] = []
        for i, t in enumerate(stash.tensors):
            if i not in stash.parked:
                out.append(t)  # type: ignore[arg-type]
                continue
            kept = stash.device.get(i, stash.parked[i])
            if i in stash.versions and kept._version != stash.versions[i]:
                raise RuntimeError(
                    "a saved block input was modified in place between the block's forward and its backward; "
                    "the recompute would start from the changed values (clone it before changing it)")
            # the cast back (on compute) is the tensor the recompute differentiates
            out.append(kept.to(stash.dtypes[i]).detach().requires_grad_())
        stash.release()
        return out

    def _fetch(self, stash: Stash) -> None:
        if not stash.on_host or stash.fetched is not None or stash.released:
            return
        h2d = self.streams.h2d
        with self.streams.on(h2d):
            self.streams.wait(h2d, stash.offloaded)
            for i, host in stash.parked.items():
                stash.device[i] = host.to(self.streams.device, non_blocking=True)
            stash.fetched = self.streams.record_on(h2d)

    def reset(self) -> None:
        self.stashes = []
        self._last_host = -1
