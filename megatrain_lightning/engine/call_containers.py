"""What a block's call is handed that torch's pytree does not look into (:func:`refuse_hidden_grad_tensors`) or that it
may write into: mappings and lists among its arguments (Gemma3n's and Gemma4's ``shared_kv_states``), and transformers'
KV caches.

The first call (``first_call.py``) refuses a block that writes into a plain one in a step (the block is handed
torch's pytree's rebuild of it: the caller's would not change), or writes tensors with a gradient history into one, and runs
a block's forward again to find the weights whose dtype matters (``wide_weights.dtype_reads``): with a KV cache
never (a run appends to its tensors), with containers from their contents before the call, and back to those after
it (:class:`Snapshot`: what the forward puts into or takes out of them, not a tensor it changes in place).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree

FIX = "or stream another level with block_class=..."  # the last words of every refusal's fix


def containers(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """The mutable containers (mappings, lists) among a block's arguments, named as its forward takes them."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"{k!r} argument", v) for k, v in kwargs.items()]
    return [(n, v) for n, v in named if isinstance(v, (MutableMapping, list))]


def tensors_in(value: Any, depth: int = 3) -> Iterator[Any]:
    """The tensors in a container, nested ``depth`` levels deep (Gemma3n: layer type -> (keys, values))."""
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

    def differs(self, container: Any) -> bool:
        """Whether ``container`` (one this snapshot holds) now holds other items than it held then."""
        held = next(items for c, items in self.held if c is container)
        now = list(container.items()) if isinstance(container, MutableMapping) else list(enumerate(container))
        return len(now) != len(held) or any(a != b or x is not y for (a, x), (b, y) in zip(now, held))

    def restore(self) -> None:
        for c, items in self.held:
            if isinstance(c, MutableMapping):
                c.clear()
                c.update(items)
            else:
                c[:] = [v for _, v in items]


_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def refuse_hidden_grad_tensors(index: int, block: nn.Module, args: tuple, kwargs: dict) -> None:
    """A call with grad: refuses a tensor with a gradient history that an argument holds where torch's pytree
    does not look (a dataclass's field, an object's attribute, a subclass of dict or list, which it leaves whole).
    The Function would take it as a constant of the call, so no gradient would flow back through it. Every call
    (such arguments may be built per step); about 10 us for a decoder layer's arguments."""
    hidden = []
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, (torch.Tensor, nn.Module, type, *_PLAIN)) or callable(leaf) or not hasattr(leaf, "__dict__"):
            continue
        if isinstance(leaf, (Mapping, list, tuple)) and any(t.requires_grad for t in tensors_in(leaf)):
            hidden.append(f"an item of its {type(leaf).__name__}")
        for attr, value in vars(leaf).items():
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(value)):
                hidden.append(f"{type(leaf).__name__}.{attr}")
    if hidden:
        raise RuntimeError(
            f"MegaTrainStrategy cannot train block {index} ({type(block).__name__}) exactly: an argument of its "
            f"call holds a tensor with a gradient history where torch's pytree does not look ({', '.join(hidden[:4])}), "
            "so the streamed block would take it as a constant and no gradient would flow back through it. Pass "
            "the tensor as an argument of its own (or in a plain tuple, list or dict), register the class with "
            f"torch.utils._pytree.register_dataclass, {FIX}")
