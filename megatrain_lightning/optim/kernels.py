"""The one dispatch from a store's pieces to the kernel that updates them.

Three kinds of update, each with a torch reference and, where it builds, the one-pass C kernel
(``native.py``) that reproduces it bit for bit:

* fp32 state, fp32 gradients: torch's fused AdamW (``adam.step_fp32``); nothing faster exists.
* fp32 state, bf16 gradients (``FlatStore.hold_half_grad``): the native kernel widens in a register,
  else ``adam.step_half_chunked`` widens chunk by chunk; the fp32 gradients of the one-dimensional
  weights held beside them go through the fused AdamW.
* compact state: the native kernel, with each span's tail (under 16 elements: torch's scalar loop)
  through ``compact.step_compact_chunked``, which does the whole span where the kernel is unavailable.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..engine.store import FlatStore
from . import native
from .adam import AdamHyper, Piece, step_fp32, step_half_chunked
from .compact import step_compact_chunked


def update(store: FlatStore, pieces: Sequence[Piece], hyper: AdamHyper) -> None:
    """Adam(W) of ``store`` over ``pieces`` (steps already incremented); see the module docstring."""
    if not pieces:
        return
    ea, eas = store.moment_buffers()
    if store.compact:
        step_compact(store.master, store.master_low, ea, eas, pieces, hyper)
    elif store.half_grad is not None:  # the one-dimensional weights' gradients beside them are fp32
        step_half(store.master, ea, eas, store.half_grad, [p for p in pieces if p.grad.dtype != torch.float32], hyper)
        step_fp32(store.master, ea, eas, [p for p in pieces if p.grad.dtype == torch.float32], hyper)
    else:
        step_fp32(store.master, ea, eas, pieces, hyper)


def step_half(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
              pieces: Sequence[Piece], hyper: AdamHyper) -> None:
    """fp32 state from bf16 gradients ``grad`` (flat, laid out as ``master``; the pieces' ``grad`` are its
    slices): the one-pass kernel where it builds, else the chunked widening."""
    kernel = native.kernel()
    if kernel is not None:
        kernel.step(master, exp_avg, exp_avg_sq, grad, pieces, hyper)
    else:
        step_half_chunked(master, exp_avg, exp_avg_sq, pieces, hyper)


def step_compact(master: torch.Tensor, master_low: torch.Tensor | None, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, spans: Sequence[Piece], hyper: AdamHyper) -> None:
    """Compact state: the one-pass kernel but the spans' tails, then the chunked path on what is left."""
    kernel = native.kernel()
    if kernel is not None and kernel.compact:
        spans = kernel.compact_step(master, master_low, exp_avg, exp_avg_sq, spans, hyper)
    step_compact_chunked(master, master_low, exp_avg, exp_avg_sq, spans, hyper)


def half_grads_pay() -> bool:
    """Whether bf16 gradients make the host update faster here: where the one-pass kernel builds (it is
    built now, on first call)."""
    return native.kernel() is not None
