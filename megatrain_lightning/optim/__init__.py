"""The host optimizer: Adam(W) on the flat host buffers, Lightning-free and without import cycles.

Modules, from the bottom: ``adam`` (torch's fused kernel over flat views; the reference), ``compact``
(compact-state update in torch ops), ``native`` (+ ``native_adam.c``: the one-pass kernels, checked bit
for bit against the two), ``kernels`` (the one dispatch from a store's pieces to a kernel) and
``host_optimizer`` (the user's optimizer stepped on the store; the one span builder).
"""

from .adam import AdamHyper, Piece
from .host_optimizer import HostAdamW, HostOptimizer, StoreUpdate, chain_zero_grad, is_fast_adam

__all__ = ["AdamHyper", "Piece", "HostAdamW", "HostOptimizer", "StoreUpdate", "chain_zero_grad", "is_fast_adam"]
