"""Initialising modules that were built on the meta device (``configure_model`` under MegaTrainStrategy).

The engine hands over each freshly materialised module (children before parents); this picks the
initialisation its author defined: the enclosing Hugging Face model's ``_init_weights`` (which knows its
special parameters: attention sinks, batched experts, rotary buffers), else the module's own
``reset_parameters()``, as Lightning's FSDP does. A module with neither is refused by name rather than
left holding uninitialised memory.

A model may also carry a *weights source* (:func:`attach_weights_source`), e.g. a local Hugging Face
checkpoint (``models/safetensors_source.py``): then each materialised module of that model is filled
with its own tensors read from the source, block by block as the engine builds the store, so a
pretrained model is never held twice on the host. Buffers a checkpoint does not hold (non-persistent
ones, such as rotary ``inv_freq``) are still computed by the initialisation above.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
from torch import nn

_SOURCE_ATTR = "_megatrain_weights_source"


class WeightsSource(Protocol):
    """Where the tensors of a meta-built model come from, instead of a random initialisation."""

    def fill(self, modules: Sequence[nn.Module]) -> None:
        """Copy each module's own parameters and persistent buffers (``recurse=False``) into it."""

    @property
    def complete(self) -> bool:
        """True once every tensor the source owes the model has been filled."""


def attach_weights_source(model: nn.Module, source: WeightsSource) -> None:
    """Have :func:`initializer_for` fill ``model``'s tensors from ``source`` when they are materialised.

    A plain attribute, not a submodule: it stays out of ``state_dict()`` and device moves, and is
    dropped once the source is complete.
    """
    object.__setattr__(model, _SOURCE_ATTR, source)


def weights_source(model: nn.Module) -> WeightsSource | None:
    """The weights source attached to ``model`` itself (not to a submodule), if any."""
    return model.__dict__.get(_SOURCE_ATTR)


def initializer_for(root: nn.Module) -> Callable[[Sequence[nn.Module]], None]:
    """The ``init`` callback of :class:`~megatrain_lightning.engine.StreamingEngine` for ``root``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers is a dependency, but the init policy does not require it
        PreTrainedModel = ()  # type: ignore[assignment,misc]
    owner: dict[int, nn.Module] = {}
    sourced: dict[int, nn.Module] = {}  # id(submodule) -> the outermost module carrying a weights source
    for m in root.modules():  # pre-order: an inner Hugging Face model overrides its parent's entry
        if isinstance(m, PreTrainedModel):
            for sub in m.modules():
                owner[id(sub)] = m
        if weights_source(m) is not None:
            for sub in m.modules():
                sourced.setdefault(id(sub), m)

    def init(modules: Sequence[nn.Module]) -> None:
        nonlocal drew
        to_fill: dict[int, tuple[nn.Module, list[nn.Module]]] = {}
        for m in modules:
            carrier = sourced.get(id(m))
            if carrier is not None and weights_source(carrier) is not None:
                to_fill.setdefault(id(carrier), (carrier, []))[1].append(m)
                if not _computed_buffers(m):
                    continue  # every tensor it holds comes from the source
                # else: initialise first (computes the buffers); the source then overwrites the rest
            else:
                drew = True  # no weights source: the values below are random
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
        for carrier, group in to_fill.values():
            source = weights_source(carrier)
            assert source is not None
            source.fill(group)
            if source.complete:
                carrier.__dict__.pop(_SOURCE_ATTR, None)  # nothing left to read: release the file index

    drew = False
    init.drew_random = lambda: drew  # type: ignore[attr-defined]  # whether any module got a random init
    return init


def _computed_buffers(m: nn.Module) -> bool:
    """Whether ``m`` owns non-persistent buffers: no checkpoint holds them, so they are computed."""
    return any(name in m._non_persistent_buffers_set for name, b in m._buffers.items() if b is not None)


def _rebuild_rotary(m: nn.Module) -> None:
    """Hugging Face rotary embeddings compute their frequency buffers in ``__init__``: compute them again."""
    if "RotaryEmbedding" not in type(m).__name__ or not hasattr(m, "config"):
        return
    with torch.device("cpu"):
        fresh = type(m)(config=m.config)
    for name, buf in fresh.named_buffers(recurse=False):
        if name in m._buffers:
            m._buffers[name] = buf.to(torch.float32) if buf.is_floating_point() else buf
