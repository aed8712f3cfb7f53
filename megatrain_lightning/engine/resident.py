"""The resident parameters: what runs outside the streamed blocks (embeddings, final norm, LM head).

They stay on the device for a whole step, as fp32 copies of their host masters, in up to two parts, each
with a store of its own:

* **before** (``RESIDENT``): parameters of modules that come before the last block, or are shared with
  one (the input embedding; a tied LM head). The next forward needs them first.
* **after** (``RESIDENT_AFTER``): parameters that only modules after the last block own (the final norm,
  an untied LM head). Their gradients are final once the loss's backward has run, before any block's
  backward begins, so the engine sends them home then: their host update overlaps the backward instead of
  following it, and the next forward needs them only at its end. For a 7B model with an untied head that
  takes half of the resident part (0.55 B parameters) off the path between one step and the next.

"Before" and "after" follow the module registration order (``named_modules``), which is the forward order
of every model this package knows; the engine checks it at run time and sends the after part with the
rest at the end of the backward whenever a step does not keep to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from .host_store import FlatStore

RESIDENT = -1  # counter and job key of the part used before the blocks
RESIDENT_AFTER = -2  # counter and job key of the part used only after them


@dataclass
class ResidentPart:
    """One resident store and its device copy during a step.

    Buffer lifetime: ``device`` is allocated on first use and kept until the engine closes; it holds the
    fp32 copy of the masters from the step's first use (``stale`` False) until the next optimizer step.
    """

    key: int  # RESIDENT or RESIDENT_AFTER: counters and update futures
    priority: int  # the host worker's order: where the next forward needs it
    store: FlatStore
    device: torch.Tensor | None = None
    views: list[torch.Tensor] = field(default_factory=list)
    on_device: bool = False  # the parameters' ``.data`` are the device views
    stale: bool = True  # the masters changed since the device copy was made
    saved_grads: list[torch.Tensor | None] = field(default_factory=list)  # host ``.grad`` parked during a step
    sent_early: bool = False  # this backward's gradients went home at its first block


def resident_names(root: nn.Module, blocks: Sequence[nn.Module]) -> tuple[list[str], list[str]]:
    """Names of the resident parameters of ``root`` used before the last block, and only after it.

    A parameter is "after" when every module that holds it comes after the last module inside the blocks
    in ``named_modules()`` order; tied parameters held by an earlier module (a tied LM head) are "before".
    """
    block_ids = {id(b) for b in blocks}
    inside: set[int] = set()
    for b in blocks:
        inside.update(id(m) for m in b.modules())
    order: dict[int, int] = {}
    last_block = -1
    for i, (_, m) in enumerate(root.named_modules(remove_duplicate=False)):
        order.setdefault(id(m), i)
        if id(m) in inside or id(m) in block_ids:
            last_block = i
    first_owner: dict[int, int] = {}
    for m in root.modules():
        if id(m) in inside:
            continue
        for p in m._parameters.values():
            if p is not None:
                first_owner[id(p)] = min(first_owner.get(id(p), order[id(m)]), order[id(m)])
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    before, after = [], []
    for name, p in root.named_parameters():
        if id(p) in in_blocks:
            continue
        (after if first_owner[id(p)] > last_block else before).append(name)
    return before, after
