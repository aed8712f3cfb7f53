# python recipes/measure_hardware.py --name h100 > megatrain_lightning/conf/hardware/h100.yaml
"""Measure the numbers of a hardware profile on this machine and print it as a `conf/hardware` YAML.

What the planner reads from a profile, measured the way the shipped profiles were: the pinned host->device
copy bandwidth (`link_gb_per_s`, the best of --repeats copies of --copy-gb; device->host printed beside it),
the bf16 matmul rate at 8192^3 (`peak_bf16_tflops`, the denominator of MFU), torch's fused fp32 AdamW on the
host over --params parameters (`host_adam_gparams_per_s`, HostOptimizer's fp32 step), the device's own update
over as many (`device_update_gparams_per_s`: bf16 gradients widened, the fused fp32 AdamW, the weights cast into a
bf16 slot, as engine/device_update.py runs it), and the memory sizes (device: total; host: MemTotal). Needs CUDA. About 30 B/param of host memory for the AdamW part.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from torch import nn

from megatrain_lightning.engine.host_buffers import PinnedRegistry
from megatrain_lightning.engine.store import FlatStore
from megatrain_lightning.hardware import PINNED_FRACTION, measured_host_memory_gb
from megatrain_lightning.optim.adam import AdamHyper, Piece, step_fp32

GB = 1e9


def _best_cuda(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()  # sync: warm-up done before the clock starts
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()  # sync: the work timed is finished
        best = min(best, time.perf_counter() - t0)
    return best


def link(copy_gb: float, repeats: int) -> tuple[float, float]:
    n = int(copy_gb * GB)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    h2d = _best_cuda(lambda: dev.copy_(host, non_blocking=True), repeats)
    d2h = _best_cuda(lambda: host.copy_(dev, non_blocking=True), repeats)
    return n / h2d / GB, n / d2h / GB


def matmul(repeats: int, n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = _best_cuda(lambda: [a @ b for _ in range(10)], repeats)
    return 10 * 2 * n**3 / t / 1e12


def host_adam(params: float, repeats: int) -> float:
    n = int(params)
    store = FlatStore([nn.Parameter(torch.randn(n) * 0.02)], PinnedRegistry(False))
    ea, eas = store.moment_buffers()
    grad, step = torch.randn(n) * 1e-3, torch.tensor(0.0)
    hyper = AdamHyper(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False)
    best = float("inf")
    for _ in range(repeats + 1):  # the first: page faults, scratch
        step.add_(1)
        t0 = time.perf_counter()
        step_fp32(store.master, ea, eas, [Piece(0, n, grad, step)], hyper)
        best = min(best, time.perf_counter() - t0)
    return n / best / 1e9


def device_update(params: float, repeats: int, device: str = "cuda") -> float:
    """G params/s of the device's update of a block (engine/device_update.py): its bf16 gradient widened to fp32,
    one fused AdamW over the fp32 masters and moments, the new weights cast into the block's bf16 slot."""
    n = int(params)
    master, m, v = (torch.zeros(n, device=device) for _ in range(3))
    grad, slot = torch.randn(n, device=device, dtype=torch.bfloat16) * 1e-3, torch.empty(n, device=device, dtype=torch.bfloat16)
    step = torch.ones((), device=device)
    hyper = AdamHyper(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False)

    def update() -> None:
        step_fp32(master, m, v, [Piece(0, n, grad.float(), step)], hyper)
        slot.copy_(master)

    if device == "cuda":
        return n / _best_cuda(update, repeats) / 1e9
    update()
    return n / min(_timed(update) for _ in range(repeats)) / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", required=True, help="the profile's name (its file name under conf/hardware)")
    ap.add_argument("--copy-gb", type=float, default=2.0)
    ap.add_argument("--params", type=float, default=256e6)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("measure_hardware.py measures a GPU machine: CUDA is not available here.")
    props = torch.cuda.get_device_properties(0)
    h2d, d2h = link(args.copy_gb, args.repeats)
    tflops = matmul(args.repeats)
    adam = host_adam(args.params, args.repeats)
    on_device = device_update(args.params, args.repeats)
    host = measured_host_memory_gb()
    print(f"# {props.name}, {props.total_memory / GB:.0f} GB; host {host:.0f} GB, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}; torch {torch.__version__}; measured {time.strftime('%Y-%m-%d')}"
          f" by recipes/measure_hardware.py")
    print("defaults: [default]")
    print(f"name: {args.name}")
    print(f"device_memory_gb: {props.total_memory / GB:.0f}")
    print(f"host_memory_gb: {host:.0f}")
    print(f"link_gb_per_s: {h2d:.0f}       # pinned host->device, best of {args.repeats} x {args.copy_gb:g} GB"
          f" (device->host: {d2h:.0f})")
    print(f"peak_bf16_tflops: {tflops:.0f}   # bf16 matmul 8192^3, best of {args.repeats}")
    print("micro_batch: 4")
    print(f"pinned_budget_gb: {PINNED_FRACTION * host:.0f}   # {PINNED_FRACTION:.0%} of the host, as hardware=auto allows")
    print(f"host_adam_gparams_per_s: {adam:.1f}  # torch fused fp32 AdamW, {args.params / 1e6:.0f} M params")
    print(f"device_update_gparams_per_s: {on_device:.0f}  # bf16 grads widened, fused fp32 AdamW, cast to bf16, "
          f"{args.params / 1e6:.0f} M params")


if __name__ == "__main__":
    main()
