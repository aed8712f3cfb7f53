"""Initialising modules that were built on the meta device (``configure_model`` under MegaTrainStrategy).

The engine hands over each freshly materialised module (children before parents); this picks the
initialisation its author defined: the enclosing Hugging Face model's ``_init_weights`` (which knows its
special parameters: attention sinks, batched experts, rotary buffers), else the module's own
``reset_parameters()``, as Lightning's FSDP does. A module with neither is refused by name rather than
left holding uninitialised memory.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn


def initializer_for(root: nn.Module) -> Callable[[Sequence[nn.Module]], None]:
    """The ``init`` callback of :class:`~megatrain_lightning.engine.pipeline.StreamingEngine` for ``root``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers is a dependency, but the init policy does not require it
        PreTrainedModel = ()  # type: ignore[assignment,misc]
    owner: dict[int, nn.Module] = {}
    for m in root.modules():  # pre-order: an inner Hugging Face model overrides its parent's entry
        if isinstance(m, PreTrainedModel):
            for sub in m.modules():
                owner[id(sub)] = m

    def init(modules: Sequence[nn.Module]) -> None:
        for m in modules:
            hf = owner.get(id(m))
            if hf is not None:
                hf._init_weights(m)  # type: ignore[operator]
                _rebuild_rotary(m)
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()
            elif isinstance(m, nn.MultiheadAttention):
                m._reset_parameters()
            else:
                raise TypeError(
                    f"{type(m).__name__} was built on the meta device (configure_model under MegaTrainStrategy) "
                    "but defines no reset_parameters() to initialise its tensors. Add one, build the module in "
                    "__init__ instead, or pass MegaTrainStrategy(meta_init=False)."
                )

    return init


def _rebuild_rotary(m: nn.Module) -> None:
    """Hugging Face rotary embeddings compute their frequency buffers in ``__init__``: compute them again."""
    if "RotaryEmbedding" not in type(m).__name__ or not hasattr(m, "config"):
        return
    with torch.device("cpu"):
        fresh = type(m)(config=m.config)
    for name, buf in fresh.named_buffers(recurse=False):
        if name in m._buffers:
            m._buffers[name] = buf.to(torch.float32) if buf.is_floating_point() else buf
