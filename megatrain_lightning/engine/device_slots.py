"""Device-side weight slots and the binding of a block module to the weights in a slot.

A slot is one flat device buffer in the compute dtype, as large as the largest block. A block's master
weights arrive in one host→device copy (fp32, into a staging buffer that is then cast on the device
when the compute dtype is narrower), and the block runs with its parameters *bound* to views of the
slot: the module object itself runs, so every per-layer attribute it owns (its ``layer_idx``, its
``sliding_window``, attention sinks) is its own, never another layer's. Binding swaps entries of each
submodule's ``_parameters`` dict for the duration of one call and restores the host Parameters after.

Memory per slot: ``max_block_numel`` x (compute dtype bytes + 4 if a staging buffer is needed).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn


class BlockBinding:
    """Where each parameter and buffer of a block lives in its submodules, so they can be swapped fast."""

    def __init__(self, block: nn.Module, params: Sequence[nn.Parameter]) -> None:
        self.block = block
        by_id: dict[int, list[tuple[nn.Module, str]]] = {}
        buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        for mod in block.modules():
            for name, p in mod._parameters.items():
                if p is not None:
                    by_id.setdefault(id(p), []).append((mod, name))
            for name, b in mod._buffers.items():
                if b is not None:
                    buffers.append((mod, name, b))
        self.param_sites = [by_id[id(p)] for p in params]
        self.params = list(params)
        self.buffer_sites = buffers
        self.device_buffers: list[torch.Tensor] = [b for _, _, b in buffers]

    def buffers_to(self, device: torch.device) -> None:
        """Keep a device copy of the block's buffers for the whole run (they are small and read-only)."""
        self.device_buffers = [b.to(device) for _, _, b in self.buffer_sites]

    @contextmanager
    def bound(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """Run the block with ``tensors`` (layout order) in place of its parameters."""
        for sites, t in zip(self.param_sites, tensors):
            for mod, name in sites:
                mod._parameters[name] = t  # type: ignore[assignment]
        for (mod, name, _), b in zip(self.buffer_sites, self.device_buffers):
            mod._buffers[name] = b
        try:
            yield
        finally:
            for sites, p in zip(self.param_sites, self.params):
                for mod, name in sites:
                    mod._parameters[name] = p
            for mod, name, b in self.buffer_sites:
                mod._buffers[name] = b


class DeviceSlots:
    """``depth`` reusable flat weight buffers on the device (and fp32 staging when casting on device)."""

    def __init__(self, depth: int, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        if depth < 2:
            raise ValueError(f"slots={depth}: at least 2 device slots are needed to overlap copy and compute")
        self.depth = depth
        self.numel = numel
        self.dtype = dtype
        self.device = device
        self.buffers = [torch.empty(numel, dtype=dtype, device=device) for _ in range(depth)]
        needs_staging = dtype != torch.float32
        self.staging = [torch.empty(numel, device=device) for _ in range(depth)] if needs_staging else None
        self.block_in_slot: list[int | None] = [None] * depth

    def invalidate(self) -> None:
        """Forget what each slot holds (after the masters changed)."""
        self.block_in_slot = [None] * self.depth

    def slot_of(self, block: int) -> int | None:
        for s, b in enumerate(self.block_in_slot):
            if b == block:
                return s
        return None
