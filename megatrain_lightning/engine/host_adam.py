"""Host-side Adam/AdamW over views of the flat host buffers: one fused, multi-threaded call per range.

``torch._fused_adamw_`` / ``torch._fused_adam_`` on CPU tensors run the whole update (moments, bias
correction, decoupled or L2 weight decay, parameter write) in one vectorised pass per tensor, spread over
the intra-op thread pool: about 4 G params/s on a 16-core Xeon, against ~1 G/s for the foreach path.
The lists handed in here are views into a block's flat master/gradient/moment buffers, cached per
(block, param group), so a step makes no per-parameter Python loop.

``compact_adam_step`` is the same update for ``host_state="compact"`` stores (bf16 high half + int16 low
half of the fp32 master, bf16 moments): chunk by chunk, the fp32 values are rebuilt in scratch, the same
fused kernel runs on them, and the results are split and rounded back.

Both the bf16-gradient update and the compact one have a one-pass C kernel (``native_adam``), used where
it builds and reproduces the paths here bit for bit; the paths here are its reference and its fallback.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from .host_store import join_fp32, split_fp32


@dataclass(frozen=True)
class AdamHyper:
    """Hyperparameters of one param group, read afresh every step (schedulers change ``lr``)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    maximize: bool


def adam_kernel(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    hyper: AdamHyper,
) -> None:
    """torch's fused Adam(W) kernel on these lists, in place; ``steps`` are read, not incremented (the
    caller raises each parameter's count once, before its first piece)."""
    kernel = torch._fused_adamw_ if hyper.decoupled else torch._fused_adam_
    kernel(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), [], list(steps),
        lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=hyper.weight_decay,
        eps=hyper.eps, amsgrad=False, maximize=hyper.maximize,
    )


def fused_adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    hyper: AdamHyper,
) -> None:
    """One Adam(W) update of ``params`` in place; ``steps`` (fp32 scalars) are incremented first, as torch does."""
    if not params:
        return
    torch._foreach_add_(list(steps), 1)
    adam_kernel(params, grads, exp_avgs, exp_avg_sqs, steps, hyper)



@dataclass(frozen=True)
class Piece:
    """One parameter's run ``[start, end)`` of a flat store and its step count (already incremented)."""

    start: int
    end: int
    step: torch.Tensor


def fused_adam_step_half(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    pieces: Sequence[Piece],
    hyper: AdamHyper,
) -> None:
    """Adam(W) of fp32 ``master`` from bf16 gradients ``grad`` (same flat layout); ``pieces`` are whole
    parameters, sorted. Bit for bit :func:`fused_adam_step` on the widened gradients.

    With the one-pass kernel (``native_adam``: built at first use where a C compiler is), each gradient is
    widened in a register: 26 bytes of host memory traffic per parameter instead of 28 for fp32
    gradients. Without it, chunk by chunk: the bf16 gradients are widened into a cache-sized fp32
    scratch (exact) and one fused call updates the parameters' pieces in that chunk. Every piece starts
    at a multiple of 16 elements from its parameter's start (offsets and chunks are multiples of 16), so
    each element takes the same vectorised or tail path as in a whole-parameter call. That widening is one
    more multi-threaded op per chunk: on the 16-core H200 host it cost more than the bytes saved (3B:
    host AdamW busy 1.15 against 0.96 s per step).
    """
    if not pieces:
        return
    from . import native_adam  # deferred: native_adam builds on this module

    native = native_adam.kernel()
    if native is not None:
        native.step(master, exp_avg, exp_avg_sq, grad, pieces, hyper)
        return
    chunk = max(16, chunk_elems() // 16 * 16)  # a multiple of 16 (see above)
    g32 = _half_scratch(chunk)
    lo, hi = pieces[0].start, pieces[-1].end
    first = 0  # first piece that may overlap the chunk
    for c0 in range(lo, hi, chunk):
        c1 = min(c0 + chunk, hi)
        g32[: c1 - c0].copy_(grad[c0:c1])
        ps, gs, ms, vs, steps = [], [], [], [], []
        while pieces[first].end <= c0:
            first += 1
        for piece in pieces[first:]:
            if piece.start >= c1:
                break
            a, b = max(piece.start, c0), min(piece.end, c1)
            ps.append(master[a:b])
            gs.append(g32[a - c0 : b - c0])
            ms.append(exp_avg[a:b])
            vs.append(exp_avg_sq[a:b])
            steps.append(piece.step)
        if ps:
            adam_kernel(ps, gs, ms, vs, steps, hyper)


def _half_scratch(chunk: int) -> torch.Tensor:
    """Per-thread fp32 scratch for one chunk of widened gradients."""
    buf = getattr(_scratch, "g32", None)
    if buf is None or buf.numel() < chunk:
        buf = _scratch.g32 = torch.empty(chunk)
    return buf


# ------------------------------------------------------------------------------------- compact state
# Elements per chunk of the compact update (and of the bf16-gradient one), per intra-op thread: each thread's share of the chunk's
# scratch (fp32 weights and moments, an int32 temporary: 16 B/element) stays in its cache between the 14
# passes a chunk takes, and the chunk is large enough that the passes' per-op overhead stays small.
# Measured (recipes/benchmark_host_adam.py --chunk, compact / fp32 speed): 16 threads on the H200 host,
# 256 K per chunk 0.17x, 4 M 0.32x; 2 threads here, 256 K 0.41x, 1 M 0.51x, 4 M 0.17x.
CHUNK_PER_THREAD = 1 << 18
CHUNK_ELEMS: int | None = None  # a fixed chunk size (benchmarks); None: CHUNK_PER_THREAD x threads
# Stochastic rounding of the bf16 moments draws its 16-bit dither from a fixed random sequence of period
# P (prime): element g of a store at step t reads entry (g + t * STEP) mod P (the second moment a shifted
# one). Deterministic whatever the chunking (thread count): a resumed run rounds as the uninterrupted one
# would; no RNG call per chunk; P prime, so an element's offsets cycle through the whole sequence. The
# table holds it unrolled to P + one chunk entries, so that a chunk reads one contiguous slice.
_DITHER_P = 1_048_573
_DITHER_STEP = 7_919
_DITHER_V = _DITHER_P // 2  # the second moment's shift
_DITHER_SEED = 0x5EED
_dither: torch.Tensor | None = None
_dither_lock = threading.Lock()
_scratch = threading.local()


def chunk_elems() -> int:
    """Elements per chunk of the compact update."""
    return CHUNK_ELEMS or CHUNK_PER_THREAD * max(1, torch.get_num_threads())


def _dither_table(chunk: int) -> torch.Tensor:
    global _dither
    with _dither_lock:
        if _dither is None or _dither.numel() < _DITHER_P + chunk:
            g = torch.Generator().manual_seed(_DITHER_SEED)
            base = torch.randint(0, 1 << 16, (_DITHER_P,), dtype=torch.int32, generator=g)
            _dither = base.repeat(2 + chunk // _DITHER_P)[: _DITHER_P + chunk]  # periodic: entry i = base[i % P]
    return _dither


def _chunk_scratch(chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-thread scratch of one chunk (the overlapped update runs on the host worker thread): fp32
    weights, an int32 temporary, and fp32 exp_avg and exp_avg_sq side by side."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None or bufs[0].numel() < chunk:
        bufs = _scratch.bufs = (torch.empty(chunk), torch.empty(chunk, dtype=torch.int32), torch.empty(2 * chunk))
    return bufs


def _round_stochastic(x: torch.Tensor, dither: torch.Tensor) -> None:
    """Make fp32 ``x`` exactly bf16-representable, rounding up in magnitude with probability equal to the
    dropped fraction (unbiased), so that the next ``.copy_`` into bf16 stores it unchanged.

    Why: round-to-nearest would freeze Adam's second moment. With beta2 = 0.999 a step changes it by at
    most 0.1%, less than half a bf16 step (0.2-0.4%), so it could grow but never decay: in a simulation
    where gradients shrink 10x, sqrt(v) ends 4.3x too large after 4000 steps (stochastic: within 0.4%).
    """
    bits = x.view(torch.int32)
    bits.add_(dither)
    bits.bitwise_and_(-0x10000)  # clear the low 16 bits


@dataclass(frozen=True)
class CompactSpan:
    """One contiguous run ``[start, end)`` of a compact store updated by one call: its fp32 (or bf16)
    gradient (``end - start`` elements) and the step count its parameters share (already incremented)."""

    start: int
    end: int
    grad: torch.Tensor
    step: torch.Tensor


def compact_adam_step(
    master: torch.Tensor,
    master_low: torch.Tensor | None,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    spans: Sequence[CompactSpan],
    hyper: AdamHyper,
) -> None:
    """Adam(W) on a compact store (see host_store.py), chunk by chunk, with torch's fused arithmetic.

    Per chunk: rebuild the exact fp32 weights from the bf16 high half and the int16 low half, widen the
    bf16 moments to fp32, run ``torch._fused_adamw_`` on those fp32 copies (the same update as the fp32
    path: only the moments' storage differs), split the weights again and store the moments rounded
    stochastically to bf16. Each pass is one multi-threaded torch op over a cache-sized chunk. Without
    ``master_low`` (plain bf16 masters) the new weight is rounded to the nearest bf16.

    With the one-pass kernel (``native_adam``, where it builds and reproduces this path bit for bit) all
    of that happens per element in one pass, and only each span's tail (under 16 elements, torch's
    scalar loop) takes the chunked path below.
    """
    from . import native_adam  # deferred: native_adam builds on this module

    native = native_adam.kernel()
    if native is not None and native.compact:
        spans = native.compact_step(master, master_low, exp_avg, exp_avg_sq, spans, hyper, _dither_table(16))
    _compact_torch(master, master_low, exp_avg, exp_avg_sq, spans, hyper)


def _compact_torch(
    master: torch.Tensor,
    master_low: torch.Tensor | None,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    spans: Sequence[CompactSpan],
    hyper: AdamHyper,
) -> None:
    """:func:`compact_adam_step` in torch ops, chunk by chunk (14 passes per chunk)."""
    if not spans:
        return
    chunk = chunk_elems()
    w, tmp, mv = _chunk_scratch(chunk)
    w_bits = w.view(torch.int32)
    table = _dither_table(chunk)
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
            if g.dtype != torch.float32:  # bf16 gradients (see FlatStore.hold_half_grad): widen, exactly
                g = _half_scratch(chunk)[:n].copy_(g)
            adam_kernel([cw], [g], [cm], [cv], [span.step], hyper)
            if master_low is not None:
                split_fp32(cb, hi, master_low[c0:c1], ct)
            else:
                hi.copy_(cw)
            at = (c0 + step * _DITHER_STEP) % _DITHER_P
            _round_stochastic(cm, table[at : at + n])
            at = (at + _DITHER_V) % _DITHER_P
            _round_stochastic(cv, table[at : at + n])
            exp_avg[c0:c1].copy_(cm)
            exp_avg_sq[c0:c1].copy_(cv)
