"""What the device's memory holds, read from the caching allocator's own counters, and the measurement of
one micro-batch with them.

The strategy places memory from a measured micro-batch (``auto_placement.py``): its peak, the tokens of a
block's input, and the bytes one block's activations take when kept (the graph its recompute builds). Every
read is host-side bookkeeping of torch's allocator, never a device synchronisation. On the CPU there is no
separate device memory: every figure is 0 and nothing is measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass
class StepMemory:
    """What one measured micro-batch showed (``StreamingEngine.measure_next``), in bytes and elements."""

    peak: int = 0  # device bytes held at once, from the step's start to its backward's end
    reserved: int = 0  # the most bytes the allocator held over the same span (its tensors' and fragmentation)
    kept_graph: int = 0  # the largest graph one recompute built: a kept block's activations
    batch: int = 0  # a block input's batch and sequence (its hidden states: batch x sequence x hidden)
    seq: int = 0
    started: bool = False

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


class DeviceMemory:
    """The allocator's counters for ``device`` (zeros on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def allocated(self) -> int:
        """Bytes held by tensors now."""
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        """The most bytes held by tensors at once since :meth:`reset_peak`."""
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else 0

    def reserved(self) -> int:
        """Bytes the allocator holds now (its tensors' and the free space in its segments)."""
        return torch.cuda.memory_reserved(self.device) if self.cuda else 0

    def peak_reserved(self) -> int:
        """The most bytes the allocator held at once since :meth:`reset_peak`."""
        return torch.cuda.max_memory_reserved(self.device) if self.cuda else 0

    def usable(self) -> int:
        """Bytes this process's tensors may come to hold: what the device has free (other processes and
        this one's CUDA context excluded) plus what this process's allocator holds already, at most the
        share ``torch.cuda.set_per_process_memory_fraction`` allows it."""
        if not self.cuda:
            return 0
        free, _ = torch.cuda.mem_get_info(self.device)
        usable = free + torch.cuda.memory_reserved(self.device)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _device: 1.0)(self.device)
        if fraction < 1.0:
            usable = min(usable, int(fraction * torch.cuda.get_device_properties(self.device).total_memory))
        return usable

    def release_cached(self) -> None:
        """Give the allocator's unused blocks back (after a placement is replaced or a step ran out)."""
        if self.cuda:
            torch.cuda.empty_cache()


class StepMeter:
    """Measures the micro-batch after :meth:`measure_next` (from its step's start to its backward's end) into
    :attr:`measured`; the engine calls :meth:`begin` and :meth:`end`, the blocks :meth:`mark` / :meth:`built`
    around each recompute and :meth:`note_input` at each call."""

    def __init__(self, device: torch.device) -> None:
        self.memory = DeviceMemory(device)
        self.usable_bytes = self.memory.usable()  # made before the engine allocates anything on the device
        self.measured: StepMemory | None = None
        self._step: StepMemory | None = None

    def measure_next(self) -> None:
        self._step = StepMemory()

    @property
    def active(self) -> bool:
        return self._step is not None and self.memory.cuda

    def begin(self) -> None:
        if self.active and self._step is not None and not self._step.started:
            self._step.started = True
            self.memory.reset_peak()

    def end(self) -> None:
        if self.active and self._step is not None:
            self._step.peak = self.memory.peak()
            self._step.reserved = self.memory.peak_reserved()
            self.measured, self._step = self._step, None

    def restart(self) -> None:
        """The step being measured was aborted: measure the next one from its start."""
        if self._step is not None:
            self._step = StepMemory()

    def note_input(self, tensors: Sequence[Any]) -> None:
        """A block's call: its hidden states (the first floating-point input of three dimensions) give the
        micro-batch's tokens."""
        m = self._step
        if m is None or m.tokens:
            return
        x = next((t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 3), None)
        if x is not None:
            m.batch, m.seq = x.shape[:2]

    def mark(self) -> int:
        """Bytes allocated before a recompute (0 unless measuring)."""
        return self.memory.allocated() if self.active else 0

    def built(self, before: int) -> None:
        """A recompute built its graph: the bytes it added, the largest kept."""
        if self.active and self._step is not None:
            self._step.kept_graph = max(self._step.kept_graph, self.memory.allocated() - before)
