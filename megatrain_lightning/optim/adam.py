"""Adam(W) on the host in torch's own kernels, over views of the flat host buffers.

``torch._fused_adamw_`` / ``torch._fused_adam_`` on CPU tensors run the whole update (moments, bias
correction, decoupled or L2 weight decay, parameter write) in one vectorised pass per tensor, spread over
the intra-op thread pool: about 4 G params/s on a 16-core Xeon, against ~1 G/s for the foreach path. These
are the reference every faster kernel (``native.py``) must reproduce bit for bit, and its fallback.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import torch


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


@dataclass(frozen=True)
class Piece:
    """One run ``[start, end)`` of a flat store updated with one step count (already incremented), and
    its gradient: ``end - start`` elements, fp32 or bf16. A whole parameter, or (compact state) a run of
    adjacent parameters that share their step count and whose gradients are the store's own buffer."""

    start: int
    end: int
    grad: torch.Tensor
    step: torch.Tensor


def adam_kernel(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    hyper: AdamHyper,
) -> None:
    """torch's fused Adam(W) kernel on these lists, in place; ``steps`` are read, not incremented."""
    kernel = torch._fused_adamw_ if hyper.decoupled else torch._fused_adam_
    kernel(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), [], list(steps),
        lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=hyper.weight_decay,
        eps=hyper.eps, amsgrad=False, maximize=hyper.maximize,
    )


def step_fp32(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, pieces: Sequence[Piece],
              hyper: AdamHyper) -> None:
    """Adam(W) of flat fp32 ``master`` and moments over ``pieces`` with fp32 gradients: one fused call."""
    if pieces:
        adam_kernel([master[p.start : p.end] for p in pieces], [p.grad for p in pieces],
                    [exp_avg[p.start : p.end] for p in pieces], [exp_avg_sq[p.start : p.end] for p in pieces],
                    [p.step for p in pieces], hyper)


def step_half_chunked(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      pieces: Sequence[Piece], hyper: AdamHyper) -> None:
    """:func:`step_fp32` from bf16 gradients, in torch ops: chunk by chunk, the gradients are widened
    into a cache-sized fp32 scratch (exact) and one fused call updates the pieces' parts in that chunk.

    Every piece starts at a multiple of 16 elements from its parameter's start (offsets and chunks are
    multiples of 16), so each element takes the same vectorised or tail path as in a whole-parameter call:
    bit for bit :func:`step_fp32` on the widened gradients. The widening is one more multi-threaded op per
    chunk: on the 16-core H200 host it cost more than the bytes it saved (3B: 1.15 against 0.96 s busy).
    ``pieces`` are sorted; their ``grad`` are views of one flat bf16 buffer laid out as ``master``.
    """
    if not pieces:
        return
    chunk = max(16, chunk_elems() // 16 * 16)
    g32 = scratch("g32", chunk)
    lo, hi = pieces[0].start, pieces[-1].end
    first = 0  # first piece that may overlap the chunk
    for c0 in range(lo, hi, chunk):
        c1 = min(c0 + chunk, hi)
        ps, gs, ms, vs, steps = [], [], [], [], []
        while pieces[first].end <= c0:
            first += 1
        for piece in pieces[first:]:
            if piece.start >= c1:
                break
            a, b = max(piece.start, c0), min(piece.end, c1)
            g32[a - c0 : b - c0].copy_(piece.grad[a - piece.start : b - piece.start])
            ps.append(master[a:b])
            gs.append(g32[a - c0 : b - c0])
            ms.append(exp_avg[a:b])
            vs.append(exp_avg_sq[a:b])
            steps.append(piece.step)
        if ps:
            adam_kernel(ps, gs, ms, vs, steps, hyper)


# Elements per chunk of the chunked paths, per intra-op thread: each thread's share of the chunk's scratch
# (16 B/element in the compact path) stays in its cache between the passes a chunk takes, and the chunk is
# large enough that the passes' per-op overhead stays small. Measured (recipes/benchmark_host_adam.py
# --chunk, compact / fp32 speed): 16 threads on the H200 host, 256 K per chunk 0.17x, 4 M 0.32x; 2 threads
# here, 256 K 0.41x, 1 M 0.51x, 4 M 0.17x.
CHUNK_PER_THREAD = 1 << 18
CHUNK_ELEMS: int | None = None  # a fixed chunk size (benchmarks); None: CHUNK_PER_THREAD x threads
_scratch = threading.local()


def chunk_elems() -> int:
    """Elements per chunk of the chunked paths."""
    return CHUNK_ELEMS or CHUNK_PER_THREAD * max(1, torch.get_num_threads())


def scratch(name: str, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A per-thread scratch buffer of at least ``numel`` (the update runs on the host worker thread)."""
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        buf = torch.empty(numel, dtype=dtype)
        setattr(_scratch, name, buf)
    return buf
