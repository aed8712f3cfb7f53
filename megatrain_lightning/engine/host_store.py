"""Flat host buffers that own every byte of a block's training state.

One :class:`FlatStore` per streamed block (and one for the resident parts: embeddings, norms, head).
It lays the block's parameters out in one contiguous fp32 buffer, at offsets aligned to 64 bytes, and
turns the module's own parameters into views of it: ``state_dict()``, checkpoints and callbacks keep
seeing ordinary host tensors that *are* the master weights. The gradient accumulator and the Adam
moments use the same layout, so that one copy moves a whole block in either direction.

Memory: 4 bytes/param master, 4 gradient (allocated on first use), 8 Adam moments (allocated by the
host optimizer). Pinning, when asked for, registers the exact buffer with the CUDA driver instead of
taking it from torch's caching pinned allocator, which rounds every request up to a power of two.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

ALIGN_BYTES = 64


def _align(n: int, elems: int) -> int:
    return (n + elems - 1) // elems * elems


class FlatLayout:
    """Offsets of a list of parameters inside one flat buffer.

    Every parameter starts at a multiple of 16 elements: 64 bytes in fp32, 32 in bf16, so every view
    is aligned for vectorised host kernels and device copies.
    """

    ALIGN_ELEMS = ALIGN_BYTES // 4

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params: list[nn.Parameter] = list(params)
        self.offsets: list[int] = []
        cursor = 0
        for p in self.params:
            self.offsets.append(cursor)
            cursor = _align(cursor + p.numel(), self.ALIGN_ELEMS)
        self.numel = max(cursor, self.ALIGN_ELEMS)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like each parameter, in layout order."""
        return [flat[o : o + p.numel()].view(p.shape) for o, p in zip(self.offsets, self.params)]


class PinnedRegistry:
    """Pins existing host tensors at their exact size (``cudaHostRegister``) and unpins them on close."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and torch.cuda.is_available()
        self._registered: list[torch.Tensor] = []

    def empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        if self.enabled:
            err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            if int(err) != 0:  # fall back to the caching allocator: rounded up, but pinned
                return torch.empty(numel, dtype=dtype, pin_memory=True)
            self._registered.append(t)
        return t

    def close(self) -> None:
        for t in self._registered:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        self._registered.clear()


class FlatStore:
    """fp32 master weights (and, lazily, gradients and Adam moments) of one block, as flat host buffers.

    Construction copies each parameter's current value into the master buffer and re-points the
    parameter at its view (``param.data = view``), so the module keeps its own Parameter objects.
    """

    def __init__(self, params: Sequence[nn.Parameter], pins: PinnedRegistry) -> None:
        self.layout = FlatLayout(params)
        self._pins = pins
        self.master = pins.empty(self.layout.numel)
        self.master.zero_()  # alignment padding stays zero: it enters norms and copies
        self.grad: torch.Tensor | None = None
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        with torch.no_grad():
            for p, view in zip(self.layout.params, self.layout.views(self.master)):
                if p.dtype != torch.float32 and p.is_floating_point():
                    raise TypeError(f"parameter of dtype {p.dtype}: the host store keeps fp32 masters only")
                view.copy_(p.detach())
                p.data = view
        self.master_views = self.layout.views(self.master)

    @property
    def params(self) -> list[nn.Parameter]:
        return self.layout.params

    @property
    def numel(self) -> int:
        return self.layout.numel

    def grad_buffer(self) -> torch.Tensor:
        """The fp32 gradient accumulator (pinned: the device→host copy lands in it directly)."""
        if self.grad is None:
            self.grad = self._pins.empty(self.layout.numel)
            self.grad.zero_()
            self.grad_views = self.layout.views(self.grad)
        return self.grad

    def moment_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Adam's first and second moments, zero-initialised on first use (pageable: never copied)."""
        if self.exp_avg is None:
            self.exp_avg = torch.zeros(self.layout.numel)
            self.exp_avg_sq = torch.zeros(self.layout.numel)
        assert self.exp_avg_sq is not None
        return self.exp_avg, self.exp_avg_sq
