# python recipes/benchmark_host_adam.py --params 32e6 --threads 2
"""Host AdamW throughput, fp32 state (fp32 or bf16 gradients) against compact state, on this machine's CPU.

Options: --params (default 64e6), --threads (intra-op threads, 0: torch's default), --repeats, --chunk.
One flat store of ``--params`` parameters with a full gradient, stepped the way HostOptimizer steps it:
fp32 state with torch's fused AdamW over the store (``adam.step_fp32``); fp32 state from bf16 gradients
(``bf16_grads=True``) with the one-pass native kernel and with chunk-by-chunk widening; compact state
(``kernels.step_compact``) with the one-pass native kernel and with the chunked torch ops (rebuild fp32
weights and moments per chunk, the same fused kernel, split and round back), and plain bf16 masters (no
low half) both ways. Prints G params/s (best of ``--repeats``) for each, and the ratio to fp32.
Memory: about 30 B/param (both stores and one gradient).
"""

from __future__ import annotations

import argparse
import platform
import time
from unittest import mock

import torch
from torch import nn

from megatrain_lightning.optim import adam as host_adam
from megatrain_lightning.optim import native as native_adam
from megatrain_lightning.optim.adam import AdamHyper, Piece, step_fp32
from megatrain_lightning.optim.kernels import step_compact as compact_adam_step, step_half as fused_adam_step_half
from megatrain_lightning.engine.host_buffers import PinnedRegistry
from megatrain_lightning.engine.store import FlatStore

HYPER = AdamHyper(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False)


def _best(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch page faults, scratch allocation
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=64e6)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=0, help="compact chunk elements (0: CHUNK_ELEMS)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = int(args.params)
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(n) * 0.02)
    grad = torch.randn(n) * 1e-3
    pins = PinnedRegistry(False)

    results: dict[str, float] = {}
    fp32 = FlatStore([nn.Parameter(weight.detach().clone())], pins)
    ea, eas = fp32.moment_buffers()
    step = torch.tensor(0.0)
    results["fp32 (torch fused AdamW)"] = _best(
        lambda: (step.add_(1), step_fp32(fp32.master, ea, eas, [Piece(0, n, grad, step)], HYPER)), args.repeats)

    # fp32 state from bf16 gradients (bf16_grads=True): the one-pass kernel, and widening chunk by chunk
    grad16 = grad.to(torch.bfloat16)
    piece = [Piece(0, n, grad16, step)]
    if native_adam.kernel() is not None:
        results["fp32, bf16 grads (one-pass native kernel)"] = _best(
            lambda: (step.add_(1), fused_adam_step_half(fp32.master, ea, eas, grad16, piece, HYPER)), args.repeats)
    else:
        print(f"# one-pass native kernel unavailable: {native_adam.unavailable_reason()}")
    with mock.patch.object(native_adam, "kernel", lambda: None):
        host_adam._scratch.__dict__.clear()
        results["fp32, bf16 grads (widened chunk by chunk)"] = _best(
            lambda: (step.add_(1), fused_adam_step_half(fp32.master, ea, eas, grad16, piece, HYPER)), args.repeats)

    def compact_run(compensate: bool, native: bool) -> float:
        store = FlatStore([nn.Parameter(weight.detach().clone())], pins, "compact", compensate=compensate)
        cea, ceas = store.moment_buffers()
        st = torch.tensor(0.0)
        spans = [Piece(0, n, grad, st)]

        def once() -> None:
            st.add_(1)
            compact_adam_step(store.master, store.master_low, cea, ceas, spans, HYPER)

        patches = [mock.patch.object(host_adam, "CHUNK_ELEMS", args.chunk)] if args.chunk else []
        if not native:
            patches.append(mock.patch.object(native_adam, "kernel", lambda: None))
        for p in patches:
            p.start()
        try:
            host_adam._scratch.__dict__.clear()  # scratch sized for this chunk
            return _best(once, args.repeats)
        finally:
            for p in patches:
                p.stop()
            host_adam._scratch.__dict__.clear()

    kernel = native_adam.kernel()
    if kernel is not None and kernel.compact:
        results["compact, 8 B/param (one-pass native kernel)"] = compact_run(True, True)
    results["compact, 8 B/param (chunked torch ops)"] = compact_run(True, False)
    if kernel is not None and kernel.compact:
        results["plain bf16 masters, 6 B/param (native)"] = compact_run(False, True)
    results["plain bf16 masters, 6 B/param (chunked)"] = compact_run(False, False)

    print(f"# host AdamW, {n / 1e6:.0f} M params, {torch.get_num_threads()} intra-op threads, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    base = results["fp32 (torch fused AdamW)"]
    for name, t in results.items():
        print(f"{name:<46} {n / t / 1e9:6.3f} G params/s  {t * 1e3:8.1f} ms  x{base / t:.2f} of fp32")


if __name__ == "__main__":
    main()
