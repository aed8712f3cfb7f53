"""How long a sequence fits: the fewest offloaded blocks a run needs, and the longest context of a model on a
machine with the step time it would take.

Long context changes which memory is short: at 256 K tokens a 7B block's saved input is 3.8 GB (fp32), so
28 of them outgrow an H200 before one block's working set does. The answer combines every choice that
moves those bytes: the chunked MLP and loss (the working set), ``saved_inputs_dtype`` (half the saved
bytes) and ``offload_inputs`` (saved inputs to the host, which then grows by theirs). The planner keeps the
run's other choices and picks the fewest offloaded blocks that fit: each one offloaded costs its bytes on
the link both ways and in pinned host memory, none of which is free when copies compete with the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hardware import HardwareProfile
from .memory import GB, device_available, fits_memory, pinned_bytes
from .run import Run
from .shape import PlanShape
from .timing import step_times


@dataclass(frozen=True)
class Context:
    """The longest sequence at a run's micro-batch, and what it takes."""

    seq_len: int
    offload: int  # offload_inputs: how many of the first blocks park their inputs on the host
    recomputed: int  # blocks whose inputs could be offloaded (the rest are kept)
    step_s: float
    tokens_per_s: float
    model_tflops: float  # 6·N + 12·L·H·Q·T per token (DESIGN.md §6) at the predicted rate
    limited_by: str  # "device" or "host": what one more 128 tokens would overflow


def smallest_offload(shape: PlanShape, run: Run, available: float, host_available: float) -> int | None:
    """The fewest blocks to offload (``offload_inputs=N``) for ``run``'s shape to fit device and host
    memory, its other choices as they are; None when no count fits."""
    recomputed = shape.layers - min(run.engine.keep_activations, shape.layers)
    for n in range(recomputed + 1):
        if fits_memory(shape, run.replace(offload_inputs=n), available, host_available):
            return n
    return None


def longest_context(shape: PlanShape, run: Run, hw: HardwareProfile, limit: int = 1 << 22) -> Context | None:
    """The longest sequence (a multiple of 128 tokens) at ``run``'s micro-batch that fits ``hw`` with the
    fewest offloaded blocks it needs, and its predicted step; None when not even 128 tokens fit."""
    available, host_available = device_available(hw), hw.host_memory_gb * GB

    def offload_at(seq: int) -> int | None:
        return smallest_offload(shape, run.replace(seq_len=seq), available, host_available)

    lo, hi = 0, limit // 128  # in units of 128 tokens: fits is monotone in the length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if offload_at(mid * 128) is not None:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return None
    seq = lo * 128
    offload = offload_at(seq)
    assert offload is not None
    best = run.replace(seq_len=seq, offload_inputs=offload)
    longer = run.replace(seq_len=seq + 128, offload_inputs=shape.layers)
    limited_by = "host" if fits_memory(shape, longer, available) else "device"
    pinned_ok = hw.accelerator != "cuda" or pinned_bytes(shape, best) <= hw.pinned_budget_gb * GB
    step = step_times(shape, best, hw, pinned_ok)["step"]
    tokens = best.work.tokens * best.work.accumulate
    return Context(seq_len=seq, offload=offload, recomputed=shape.layers - min(run.engine.keep_activations, shape.layers),
                   step_s=step, tokens_per_s=tokens / step,
                   model_tflops=shape.model_flops_per_token(seq) * tokens / step / 1e12, limited_by=limited_by)
