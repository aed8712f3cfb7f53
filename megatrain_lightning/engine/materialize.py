"""Materialising a model built on the meta device, one block at a time, straight into the host store.

A model built under ``torch.device("meta")`` has shapes but no memory. The engine gives each block real
(uninitialised, fp32) host tensors just before it builds that block's flat store, has the caller's
``init`` fill them, and the store then takes them over: peak host memory is the store plus about one
block, never a second full copy of the model. Ties survive: a meta tensor shared by two modules
becomes one host tensor shared by both.
"""

from __future__ import annotations

from typing import Callable, Collection, Sequence

import torch
from torch import nn

InitFn = Callable[[Sequence[nn.Module]], None]


class MetaMaterializer:
    """Replaces meta parameters and buffers with host tensors, subtree by subtree, keeping ties."""

    def __init__(self, init: InitFn | None) -> None:
        self.init = init
        # id(meta tensor) -> (meta tensor, host tensor); the meta tensor is kept so its id is not reused
        self._memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, root: nn.Module, skip: Collection[int] = ()) -> list[nn.Module]:
        """Materialise ``root``'s subtree, not descending into modules whose id is in ``skip``.

        Returns the modules that received new tensors (children before parents), already initialised.
        """
        touched: list[nn.Module] = []

        def visit(m: nn.Module) -> None:
            for child in m._modules.values():
                if child is not None and id(child) not in skip:
                    visit(child)
            hit = False
            for name, p in list(m._parameters.items()):
                if p is not None and p.is_meta:
                    m._parameters[name] = self._host(p, lambda t: nn.Parameter(t, requires_grad=p.requires_grad))
                    hit = True
            for name, b in list(m._buffers.items()):
                if b is not None and b.is_meta:
                    m._buffers[name] = self._host(b, lambda t: t)
                    hit = True
            if hit:
                touched.append(m)

        visit(root)
        if touched:
            if self.init is None:
                names = sorted({type(m).__name__ for m in touched})
                raise ValueError(f"modules {', '.join(names)} hold meta tensors and no initialiser was given")
            with torch.no_grad():
                self.init(touched)
        return touched

    def _host(self, t: torch.Tensor, wrap: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        hit = self._memo.get(id(t))
        if hit is None:
            dtype = torch.float32 if t.is_floating_point() else t.dtype  # masters are fp32
            hit = self._memo[id(t)] = (t, wrap(torch.empty(t.shape, dtype=dtype)))
        return hit[1]


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())
