"""Adam(W) on ``host_state="compact"`` stores in torch ops: the reference of the one-pass kernel.

A compact store keeps the fp32 master exactly as a bf16 high half plus an int16 low half, and bf16
moments (``engine/store.py``). Per chunk of a span: rebuild the exact fp32 weights, widen the moments, run
torch's fused AdamW on those fp32 copies (the same update as fp32 state: only the storage differs), split
the weights again and round the moments to bf16 stochastically. Each pass is one multi-threaded torch op
over a cache-sized chunk (14 per chunk). Without the low half (plain bf16 masters, for measuring that
failure) the new weight is rounded to the nearest bf16.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from ..engine.store import join_fp32, split_fp32
from .adam import AdamHyper, Piece, adam_kernel, chunk_elems, scratch

# Stochastic rounding of the bf16 moments draws its 16-bit dither from a fixed random sequence of period
# P (prime): element g of a store at step t reads entry (g + t * STEP) mod P (the second moment a shifted
# one). Deterministic whatever the chunking (thread count): a resumed run rounds as the uninterrupted one
# would; no RNG call per chunk; P prime, so an element's offsets cycle through the whole sequence. The
# table holds it unrolled to P + one chunk entries, so that a chunk reads one contiguous slice.
DITHER_P = 1_048_573
DITHER_STEP = 7_919
DITHER_V = DITHER_P // 2  # the second moment's shift
_DITHER_SEED = 0x5EED
_dither: torch.Tensor | None = None
_dither_lock = threading.Lock()


def dither_table(chunk: int) -> torch.Tensor:
    """The dither sequence, unrolled to at least ``DITHER_P + chunk`` entries (int32, values < 2**16)."""
    global _dither
    with _dither_lock:
        if _dither is None or _dither.numel() < DITHER_P + chunk:
            g = torch.Generator().manual_seed(_DITHER_SEED)
            base = torch.randint(0, 1 << 16, (DITHER_P,), dtype=torch.int32, generator=g)
            _dither = base.repeat(2 + chunk // DITHER_P)[: DITHER_P + chunk]  # periodic: entry i = base[i % P]
    return _dither


def round_stochastic(x: torch.Tensor, dither: torch.Tensor) -> None:
    """Make fp32 ``x`` exactly bf16-representable, rounding up in magnitude with probability equal to the
    dropped fraction (unbiased), so that the next ``.copy_`` into bf16 stores it unchanged.

    Why: round-to-nearest would freeze Adam's second moment. With beta2 = 0.999 a step changes it by at
    most 0.1%, less than half a bf16 step (0.2-0.4%), so it could grow but never decay: in a simulation
    where gradients shrink 10x, sqrt(v) ends 4.3x too large after 4000 steps (stochastic: within 0.4%).
    """
    bits = x.view(torch.int32)
    bits.add_(dither)
    bits.bitwise_and_(-0x10000)  # clear the low 16 bits


def step_compact_chunked(master: torch.Tensor, master_low: torch.Tensor | None, exp_avg: torch.Tensor,
                         exp_avg_sq: torch.Tensor, spans: Sequence[Piece], hyper: AdamHyper) -> None:
    """Adam(W) of a compact store over ``spans`` (fp32 or bf16 gradients), chunk by chunk."""
    if not spans:
        return
    chunk = chunk_elems()
    w, tmp, mv = scratch("w", chunk), scratch("tmp", chunk, torch.int32), scratch("mv", 2 * chunk)
    w_bits = w.view(torch.int32)
    table = dither_table(chunk)
    for span in spans:
        step = int(span.step.item())
        for c0 in range(span.start, span.end, chunk):
            c1 = min(c0 + chunk, span.end)
            n = c1 - c0
            cw, cb, ct, cmv = w[:n], w_bits[:n], tmp[:n], mv[: 2 * n]
            cm, cv = cmv[:n], cmv[n:]
            hi = master[c0:c1]
            if master_low is not None:
                join_fp32(hi, master_low[c0:c1], cb, ct)
            else:
                cw.copy_(hi)
            cm.copy_(exp_avg[c0:c1])
            cv.copy_(exp_avg_sq[c0:c1])
            g = span.grad[c0 - span.start : c1 - span.start]
            if g.dtype != torch.float32:  # bf16 gradients (FlatStore.hold_half_grad): widen, exactly
                g = scratch("g32", chunk)[:n].copy_(g)
            adam_kernel([cw], [g], [cm], [cv], [span.step], hyper)
            if master_low is not None:
                split_fp32(cb, hi, master_low[c0:c1], ct)
            else:
                hi.copy_(cw)
            at = (c0 + step * DITHER_STEP) % DITHER_P
            round_stochastic(cm, table[at : at + n])
            at = (at + DITHER_V) % DITHER_P
            round_stochastic(cv, table[at : at + n])
            exp_avg[c0:c1].copy_(cm)
            exp_avg_sq[c0:c1].copy_(cv)
