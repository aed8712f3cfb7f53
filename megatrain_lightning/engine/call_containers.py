"""What a block's call is handed that it may write into: mappings and lists among its arguments (Gemma3n's and
Gemma4's ``shared_kv_states``), and transformers' KV caches.

The first call (``first_call.py``) refuses a block that writes tensors with a gradient history into them, and runs
a block's forward again to find the weights whose dtype matters (``wide_weights.dtype_reads``): with a KV cache
never (a run appends to its tensors), with containers from their contents before the call, and back to those after
it (:class:`Snapshot`: what the forward puts into or takes out of them, not a tensor it changes in place).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Iterator

from torch.utils import _pytree as pytree


def containers(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """The mutable containers (mappings, lists) among a block's arguments, named as its forward takes them."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"{k!r} argument", v) for k, v in kwargs.items()]
    return [(n, v) for n, v in named if isinstance(v, (MutableMapping, list))]


def tensors_in(value: Any, depth: int = 3) -> Iterator[Any]:
    """The tensors in a container, nested ``depth`` levels deep (Gemma3n: layer type -> (keys, values))."""
    import torch

    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    for v in items:
        if isinstance(v, torch.Tensor):
            yield v
        elif depth > 1:
            yield from tensors_in(v, depth - 1)


def holds_a_cache(args: tuple, kwargs: dict) -> bool:
    """Whether a transformers ``Cache`` is among a block's arguments (a run of the forward appends to it)."""
    return any(c.__name__ == "Cache" for v in pytree.tree_leaves((args, kwargs)) for c in type(v).__mro__)


class Snapshot:
    """The contents of every mapping and list a block's call is handed (``depth`` levels deep, through tuples too),
    as they are now; :meth:`restore` puts them back."""

    def __init__(self, args: tuple, kwargs: dict, depth: int = 3) -> None:
        self.held: list[tuple[Any, list[tuple[Any, Any]]]] = []
        self._take([*args, *kwargs.values()], depth)

    def _take(self, values: Any, depth: int) -> None:
        for v in values:
            if isinstance(v, MutableMapping):
                self.held.append((v, list(v.items())))
            elif isinstance(v, list):
                self.held.append((v, list(enumerate(v))))
            if depth > 1 and isinstance(v, (Mapping, list, tuple)):
                self._take(v.values() if isinstance(v, Mapping) else v, depth - 1)

    def restore(self) -> None:
        for c, items in self.held:
            if isinstance(c, MutableMapping):
                c.clear()
                c.update(items)
            else:
                c[:] = [v for _, v in items]
