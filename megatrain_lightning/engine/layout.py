"""How a block's parameters lie in one flat buffer: aligned offsets, the trainable ones first, and the
one-dimensional weights (norm gains, biases) that a device slot also holds in fp32.

The host store (``store.py``), its gradients and moments, the device slots (``slots.py``) and the
gradient slabs all use one :class:`FlatLayout`, so that one copy moves a whole block either way.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

ALIGN_BYTES = 64


def align(n: int, elems: int) -> int:
    return (n + elems - 1) // elems * elems


class FlatLayout:
    """Offsets of a list of parameters inside one flat buffer.

    Every parameter starts at a multiple of 16 elements: 64 bytes in fp32, 32 in bf16, so every view
    is aligned for vectorised host kernels and device copies.
    """

    ALIGN_ELEMS = ALIGN_BYTES // 4

    def __init__(self, params: Sequence[nn.Parameter], n_trainable: int | None = None) -> None:
        self.params: list[nn.Parameter] = list(params)
        self.offsets: list[int] = []
        cursor = 0
        for p in self.params:
            self.offsets.append(cursor)
            cursor = align(cursor + p.numel(), self.ALIGN_ELEMS)
        self.numel = max(cursor, self.ALIGN_ELEMS)

        # Weights of one dimension (norm gains, biases): in a narrow compute dtype a device slot also holds
        # them in fp32 (``wide``), packed in layout order at ``wide_offsets`` (see engine/slots.py). Not the frozen
        # ones (those after the first ``n_trainable``) given narrower than fp32: Lightning's bf16-mixed reads
        # them in their own dtype (a bf16 base's norm gains under adapters: in fp32 its norms' outputs were fp32,
        # and the gradients the matmuls read back met in fp32 where under Lightning they meet in bf16).
        trainable = len(self.params) if n_trainable is None else n_trainable
        self.wide: list[int] = [i for i, p in enumerate(self.params)
                                if p.dim() < 2 and (i < trainable or p.dtype == torch.float32)]
        self.wide_offsets: list[int] = []
        cursor = 0
        for i in self.wide:
            self.wide_offsets.append(cursor)
            cursor = align(cursor + self.params[i].numel(), self.ALIGN_ELEMS)
        self.wide_numel = cursor

    def widen(self, indices: Sequence[int]) -> list[int]:
        """Also hold the parameters at ``indices`` in fp32 in a narrow slot (weights of more dimensions that an op
        outside autocast's matmuls reads: ``wide_weights.py``), packed after the others: the offsets of those
        already wide stay. Returns the indices that were not wide before."""
        new = [i for i in dict.fromkeys(indices) if i not in self.wide]
        for i in new:
            self.wide.append(i)
            self.wide_offsets.append(self.wide_numel)
            self.wide_numel = align(self.wide_numel + self.params[i].numel(), self.ALIGN_ELEMS)
        return new

    def views(self, flat: torch.Tensor, wide: torch.Tensor | None = None,
              narrow: tuple[int, torch.dtype] | None = None) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like each parameter, in layout order; with ``wide``, the weights of one
        dimension view ``wide`` instead (their fp32 copies); with ``narrow`` = (start, dtype), the parameters
        from element ``start`` on (a frozen region) view that region's memory reinterpreted as ``dtype``, no
        wider than ``flat``'s, at the same element offsets from ``start`` (see :meth:`narrow_region`)."""
        out = [flat[o : o + p.numel()].view(p.shape) for o, p in zip(self.offsets, self.params)]
        if narrow is not None:
            start, dtype = narrow
            region = self.narrow_region(flat, start, dtype)
            for i, (o, p) in enumerate(zip(self.offsets, self.params)):
                if o >= start:
                    out[i] = region[o - start : o - start + p.numel()].view(p.shape)
        if wide is not None:
            for i, w in zip(self.wide, self.wide_offsets):
                if narrow is None or self.offsets[i] < narrow[0]:
                    out[i] = wide[w : w + self.params[i].numel()].view(self.params[i].shape)
        return out

    def narrow_region(self, flat: torch.Tensor, start: int, dtype: torch.dtype) -> torch.Tensor:
        """``flat[start:]``'s memory as ``self.numel - start`` elements of the narrower ``dtype`` (a slot's frozen
        region holding bf16 weights in an fp32 slot: they keep their dtype, as under the default strategy)."""
        return flat[start : self.numel].view(dtype)[: self.numel - start]

    def wide_pairs(self, wide: torch.Tensor, flat: torch.Tensor, start: int, end: int
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(destinations in ``wide``, sources in ``flat``) of the one-dimensional weights that lie in
        ``flat[start:end]``: what a copy into ``wide`` consists of."""
        dst, src = [], []
        for i, w in zip(self.wide, self.wide_offsets):
            o, n = self.offsets[i], self.params[i].numel()
            if start <= o < end:
                dst.append(wide[w : w + n])
                src.append(flat[o : o + n])
        return dst, src


def trainable_first(params: Sequence[nn.Parameter], trainable: set[int] | None) -> tuple[FlatLayout, int]:
    """The layout with the trainable parameters first (each group in its given order), and their count."""
    ids = {id(p) for p in params if p.requires_grad} if trainable is None else trainable
    train = [p for p in params if id(p) in ids]
    rest = [p for p in params if id(p) not in ids]
    return FlatLayout(train + rest, len(train)), len(train)


def region_split(layout: FlatLayout, n_trainable: int) -> int:
    """Where the frozen region starts: the aligned end of the trainable parameters."""
    if n_trainable == len(layout.params):
        return layout.numel
    return layout.offsets[n_trainable]
