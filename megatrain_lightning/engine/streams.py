"""The three streams of the engine and their CPU stand-ins.

Compute is the caller's current stream; host->device and device->host copies each run on a stream of
their own. Ordering between them is by events only: a stream waits for an event on the device, the host
does not block. On a machine without CUDA every copy has completed when it returns, so streams are
``None``, events are :class:`NoEvent` and every wait is a no-op: the same code path runs in CI.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class NoEvent:
    """Stands in for ``torch.cuda.Event`` on the CPU, where every copy has completed when it returns."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class Streams:
    """Compute (the caller's current stream), host->device and device->host streams; no-ops on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = torch.cuda.Stream(device) if self.cuda else None

    def event(self) -> Any:
        return torch.cuda.Event() if self.cuda else NoEvent()

    def compute(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def wait(self, waiter: Any, event: Any) -> None:
        """Make ``waiter`` (a stream) wait for ``event``: device-side, the host does not block."""
        if self.cuda:
            waiter.wait_event(event)

    def after_compute(self, stream: Any) -> None:
        """Make ``stream`` wait for everything queued on compute so far (no queued kernel may still read a
        buffer that ``stream`` is about to overwrite). Call it on the compute stream, not inside ``on(stream)``:
        there the current stream is ``stream`` itself, and waiting for it orders nothing (until 2026-12-03 the
        device update's copy home raced its AdamW kernels so: host masters and moments written half-updated)."""
        if self.cuda:
            compute = self.compute()
            if compute == stream:
                raise RuntimeError("Streams.after_compute called with the current stream as the waiter: it "
                                   "would wait for itself (call it outside `with streams.on(stream)`)")
            stream.wait_stream(compute)

    def record_on(self, stream: Any) -> Any:
        """A new event recorded on ``stream`` now."""
        ev = self.event()
        ev.record(stream)
        return ev
