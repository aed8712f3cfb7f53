"""What the package attaches to the user's modules (a block's ``forward``, an experts module's, ``zero_grad``, forward
pre-hooks, a load_state_dict hook), as a copy of those modules sees it.

``copy.deepcopy`` of a module during fit (an EMA or SWA model: timm's ``ModelEmaV3``, Lightning's
``StochasticWeightAveraging``) and pickle copy what is in its ``__dict__``. A closure would be shared by the copy, so
the copy would run the engine on the original's weights (silently wrong), and a bound hook would copy the engine itself
(a crash on its locks and queues). Each attachment is an :class:`Attached` instead: it runs the engine's callable, and
a copy of it is what the copy of the module should have: its class's own forward, bound to the copy, or no hook. A
copy is then a plain module, as under the default strategy.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch


class Attached:
    """``call`` on the original; ``copy_as`` (deep-copied along with the module holding it) on a copy."""

    __slots__ = ("call", "copy_as")

    def __init__(self, call: Callable[..., Any], copy_as: Any) -> None:
        self.call, self.copy_as = call, copy_as

    # Eager under torch.compile: where a compiled frame reaches an attachment (the user compiled a block, its parent
    # or the whole model) dynamo breaks the graph here instead of tracing the engine's streams, slots and autograd
    # Function, recompiling each per block index (3 blocks compiled by hand: 132 frames, none now; a tiny Llama
    # compiled whole: 210 frames, 42 now, and 19 s for 3 steps, 2 s now). The engine's own compiled block functions
    # (engine/compiled.py), called from in here, compile as under an eager caller.
    @torch.compiler.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> tuple[Callable[[Any], Any], tuple[Any]]:
        return _as_is, (self.copy_as,)


def method_of(owner: Any, name: str, call: Callable[..., Any]) -> Attached:
    """``call`` as ``owner``'s instance attribute ``name``, in place of a method (a module's ``forward``, its
    ``zero_grad``); a copy gets what the instance had before: its own instance attribute, or the class's method bound
    to the copy. Call before setting it."""
    held = owner.__dict__.get(name)
    return Attached(call, held if held is not None else functools.partial(getattr(type(owner), name), owner))


def hook(call: Callable[..., Any]) -> Attached:
    """``call`` as a hook; a copy of the module gets a hook that does nothing."""
    return Attached(call, _no_hook)


def _as_is(x: Any) -> Any:
    return x


def _no_hook(*args: Any) -> None:
    return None
