"""Saved block inputs parked in pinned host memory (``offload_inputs``), and brought back one block ahead.

A recomputed block saves only its inputs; the large one is the residual stream (tokens x hidden x 4 B).
Offloaded, it goes to the host on the device->host stream right after the block's forward and comes back
on the host->device stream while the backward of the block after it runs. Device memory then stays flat in
depth. Buffer lifetimes: an offloaded device tensor is recorded on the device->host stream, so the caching
allocator reuses its memory only after the copy has run; the fetched copy is recorded on compute.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .host_buffers import PinnedRegistry
from .streams import Streams


class Stash:
    """The saved inputs of one recomputed block call: device tensors, or host copies while offloaded."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors: list[torch.Tensor | None] = list(tensors)
        self.host: dict[int, torch.Tensor] = {}
        self.device: dict[int, torch.Tensor] = {}
        self.offloaded: Any = None  # event: the copies to the host have run
        self.fetched: Any = None  # event: the copies back have run
        self.index = 0
        self.released = False

    def release(self) -> None:
        self.host, self.device, self.released = {}, {}, True


class InputOffload:
    """Stashes of the current micro-batch, in forward order."""

    def __init__(self, streams: Streams, pins: PinnedRegistry, enabled: bool) -> None:
        self.streams = streams
        self.pins = pins
        self.enabled = enabled
        self.stashes: list[Stash] = []

    def stash(self, tensors: Sequence[torch.Tensor], streaming: bool) -> Stash:
        """Saved inputs of a recomputed block; offloaded: floating tensors that require grad (position
        tables and masks are shared by every block and stay on the device)."""
        stash = Stash(list(tensors))
        if not (self.enabled and streaming):
            return stash
        compute, d2h = self.streams.compute(), self.streams.d2h
        produced = self.streams.record_on(compute)
        device = self.streams.device
        for i, t in enumerate(tensors):
            if not (t.is_floating_point() and t.requires_grad and t.device == device):
                continue
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pins.enabled)
            with self.streams.on(d2h):
                self.streams.wait(d2h, produced)
                host.copy_(t.detach(), non_blocking=True)
                if self.streams.cuda:
                    t.record_stream(d2h)  # buffer lifetime: freed only after this copy has run
            stash.host[i] = host
            stash.tensors[i] = None
        if stash.host:
            stash.offloaded = self.streams.record_on(d2h)
            stash.index = len(self.stashes)
            self.stashes.append(stash)
        return stash

    def unstash(self, stash: Stash) -> list[torch.Tensor]:
        """The saved inputs back on the device (a device-side wait); the next stash back starts now."""
        self._fetch(stash)
        if stash.index > 0:
            self._fetch(self.stashes[stash.index - 1])  # backward runs in reverse: prefetch one ahead
        if stash.fetched is not None:
            compute = self.streams.compute()
            self.streams.wait(compute, stash.fetched)
            if self.streams.cuda:
                for t in stash.device.values():
                    t.record_stream(compute)
        out = [stash.device.get(i, t) for i, t in enumerate(stash.tensors)]
        stash.release()
        return out  # type: ignore[return-value]

    def _fetch(self, stash: Stash) -> None:
        if not stash.host or stash.fetched is not None or stash.released:
            return
        h2d = self.streams.h2d
        with self.streams.on(h2d):
            self.streams.wait(h2d, stash.offloaded)
            for i, host in stash.host.items():
                # only tensors that required grad were offloaded: the recompute differentiates them
                stash.device[i] = host.to(self.streams.device, non_blocking=True).requires_grad_()
            stash.fetched = self.streams.record_on(h2d)

    def reset(self) -> None:
        self.stashes = []
