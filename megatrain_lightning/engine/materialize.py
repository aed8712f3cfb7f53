"""Materialising a model built on the meta device, one block at a time, straight into the host store.

A model built under ``torch.device("meta")`` has shapes but no memory. The engine lays out each block's
flat store first, from the meta shapes, and has the materialiser give each meta parameter its view of the
store's master buffer (:meth:`MetaMaterializer.place`); the caller's ``init`` then fills those views in
place. Nothing is copied and nothing is held twice: peak host memory is the store itself, for the blocks
and for the resident part (embeddings and head) alike. Tensors without a placed view (buffers, and
parameters when the store keeps another dtype) become fresh fp32 host tensors that the store copies. Ties survive: a meta tensor shared by two modules
becomes one host tensor shared by both.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Sequence

import torch
from torch import nn

from .host_buffers import PinnedRegistry
from .layout import region_split, trainable_first
from .store import FlatStore, HostState, frozen_dtype

InitFn = Callable[[Sequence[nn.Module]], None]


class MetaMaterializer:
    """Replaces meta parameters and buffers with host tensors, subtree by subtree, keeping ties."""

    def __init__(self, init: InitFn | None) -> None:
        self.init = init
        # id(meta tensor) -> (meta tensor, host tensor); the meta tensor is kept so its id is not reused
        self._memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._placed: dict[int, torch.Tensor] = {}

    def place(self, views: dict[int, torch.Tensor]) -> None:
        """Where the next materialisation puts meta tensors: ``id(meta tensor) -> host view`` (fp32,
        its shape). The caller keeps the meta tensors alive until then, so the ids stay theirs."""
        self._placed.update(views)

    def __call__(self, root: nn.Module, skip: Collection[int] = ()) -> list[nn.Module]:
        """Materialise ``root``'s subtree, not descending into modules whose id is in ``skip``.

        Returns the modules that received new tensors (children before parents), already initialised. A
        module whose meta tensors were all materialised before (the head of a tied embedding) is not
        initialised again: the first initialisation stands, as when a tie is made after construction.
        """
        touched: list[nn.Module] = []

        def visit(m: nn.Module) -> None:
            for child in m._modules.values():
                if child is not None and id(child) not in skip:
                    visit(child)
            hit = False  # a new host tensor (not one a tie already materialised and initialised)
            for name, p in list(m._parameters.items()):
                if p is not None and p.is_meta:
                    hit |= id(p) not in self._memo
                    m._parameters[name] = self._host(p, lambda t: nn.Parameter(t, requires_grad=p.requires_grad))
            for name, b in list(m._buffers.items()):
                if b is not None and b.is_meta:
                    hit |= id(b) not in self._memo
                    m._buffers[name] = self._host(b, lambda t: t)
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
            host = self._placed.pop(id(t), None)
            if host is None:
                dtype = torch.float32 if t.is_floating_point() else t.dtype  # masters are fp32
                host = torch.empty(t.shape, dtype=dtype)
            hit = self._memo[id(t)] = (t, wrap(host))
        return hit[1]


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def build_stores(
    module: nn.Module,
    groups_of: Callable[[], list[list[nn.Parameter]]],
    materializer: MetaMaterializer,
    pins: PinnedRegistry,
    host_state: HostState,
    skip: Collection[int] = (),
    names: Sequence[str] | None = None,
    write: bool = True,
) -> list[FlatStore | None]:
    """Materialise ``module`` (not descending into ``skip``) and build one store per group of
    ``groups_of()`` (None for an empty group; called again after materialising, for the host tensors):
    :func:`place_stores` then :func:`finish_stores`."""
    buffers = place_stores(groups_of(), materializer, pins, host_state, names, write)
    return finish_stores(module, groups_of, materializer, pins, host_state, buffers, skip)


def place_stores(groups: list[list[nn.Parameter]], materializer: MetaMaterializer, pins: PinnedRegistry,
                 host_state: HostState, names: Sequence[str] | None = None, write: bool = True) -> list[dict[str, Any]]:
    """The host buffers of one store per group, allocated now: fp32 stores are laid out from the meta
    shapes (trainable parameters first, as the store lays them out) and the meta parameters are placed as
    views of the store's buffers, so that initialisation, whenever it comes, writes the store directly (no
    second copy of anything)."""
    buffers: list[dict[str, Any]] = []
    names = list(names) if names is not None else [None] * len(groups)
    for params, name in zip(groups, names):
        bufs: dict[str, Any] = {"name": name, "write": write}
        if host_state == "fp32" and any(p.is_meta for p in params):
            layout, n_trainable = trainable_first(params, None)  # as FlatStore lays them out
            n = region_split(layout, n_trainable)
            master = pins.shared(name and f"{name}.master", n, torch.float32, pin=True)
            frozen = pins.shared(name and f"{name}.frozen", layout.numel - n, frozen_dtype(layout.params[n_trainable:]),
                                 pin=True)
            if pins.arena is None or name is None:
                master.zero_()  # alignment padding stays zero (a shared buffer is born zero)
                frozen.zero_()
            views = [master[o : o + p.numel()].view(p.shape) for o, p in zip(layout.offsets, layout.params[:n_trainable])]
            views += [frozen[o - n : o - n + p.numel()].view(p.shape)
                      for o, p in zip(layout.offsets[n_trainable:], layout.params[n_trainable:])]
            materializer.place({id(p): v for p, v in zip(layout.params, views) if p.is_meta})
            bufs.update(master=master, frozen=frozen)
        buffers.append(bufs)
    return buffers


def finish_stores(module: nn.Module, groups_of: Callable[[], list[list[nn.Parameter]]], materializer: MetaMaterializer,
                  pins: PinnedRegistry, host_state: HostState, buffers: list[dict[str, Any]],
                  skip: Collection[int] = ()) -> list[FlatStore | None]:
    """Materialise what of ``module`` is still meta (not descending into ``skip``) and build the stores
    over the buffers of :func:`place_stores`."""
    materializer(module, skip=skip)
    return [FlatStore(params, pins, host_state, **bufs) if params else None
            for params, bufs in zip(groups_of(), buffers)]


def before_blocks(root: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """The subtrees of ``root`` that come before its first block in module order (an embedding): a meta
    model's random initialisation draws for them first, as ``init_weights`` (children first, in order) does."""
    if not blocks:
        return []
    first = blocks[0]
    out: list[nn.Module] = []

    def walk(m: nn.Module) -> bool:  # True once the first block is reached
        for child in m.children():
            if child is first:
                return True
            if any(c is first for c in child.modules()):
                return walk(child)
            out.append(child)
        return False

    walk(root)
    return out
