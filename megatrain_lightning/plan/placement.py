"""The placement the planner chooses for a run whose ``strategy.engine`` leaves it open (None fields).

Which blocks keep their activations (and what they save), which keep their weights on the device, and how
many saved inputs go to the host, are chosen here from the planner's own memory and time models
(``memory.py``, ``timing.py``; their device peak was within -0.3 to +2.7 % of the allocator's on the H200
runs of ``recipes/results/2026-11-30-planner-vs-measured.md``): every candidate that fits
:data:`HEADROOM` of the device is timed and the fastest taken. Per number of kept blocks the most weights
that still fit are cached (their copies then happen once per step); saved inputs are offloaded only when
nothing else fits, and then as few as fit (``context.smallest_offload``); the host AdamW is timed
:data:`HOST_MARGIN` slower than the model's rate. Selective saves (``"matmuls"``)
are taken only when they predict a step at least :data:`MATMULS_MARGIN` faster: the model does not charge
the elementwise recompute they cost (a few percent of a kept block's time, ``engine/selective.py``).

Only for a CUDA profile: on the CPU the device is the host, and the streaming placement is kept
(``config.STREAMING``). A field the user set is never changed. Lightning-free.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..config import EngineConfig
from ..hardware import HardwareProfile
from .context import smallest_offload
from .fit import resolve
from .memory import GB, device_available, fits_memory, gpu_bytes, gpu_peak, pinned_bytes
from .run import Workload
from .shape import PlanShape
from .timing import step_times

# The fraction of the device's memory a chosen placement may plan for: the rest covers the allocator's
# fragmentation (reserved exceeded allocated by 3.0 % at 7B, 3.3 % at 3B) and the planner's error.
HEADROOM = 0.92
MATMULS_MARGIN = 0.03
# Candidates are timed with the host AdamW this much slower than the model's rate: where the host and the
# device take about as long, the step is as long as the slower of the two on the step (the in-step host rate
# varied 0.82-0.90 s at 3B), so a placement that leaves the host some room is worth more than the model says.
# Measured at 3B (2026-12-03, session 11): update_on_device=4 with 34 kept blocks, timed 0.787 s with the host
# at 0.787 s, ran 0.883-0.989 s; 8 blocks with 33 kept, timed 0.794 s with the host at 0.69 s, ran 0.809-0.813 s.
HOST_MARGIN = 1.1


def choose_placement(shape: PlanShape, work: Workload, engine: EngineConfig, hw: HardwareProfile,
                     headroom: float = HEADROOM, budget: float | None = None,
                     accept: Callable[[EngineConfig], bool] | None = None) -> EngineConfig:
    """``engine`` with its unset placement fields chosen for ``work`` on ``hw`` (see the module docstring);
    the streaming values where nothing fits (the plan then says why) or off CUDA. ``budget``: the device
    bytes to plan for, instead of ``headroom`` of the profile's device memory. ``accept``: a second test every
    candidate must pass (the strategy's prediction from a measured step, ``measured.Measured.fits``)."""
    unset = set(engine.unset)
    if not unset or hw.accelerator != "cuda":
        return engine.filled()
    budget = device_available(hw) * headroom if budget is None else budget
    host = hw.host_memory_gb * GB
    layers = shape.layers

    def fits(cand: EngineConfig) -> bool:
        return (fits_memory(shape, resolve(shape, work, cand, hw, tried=True), budget, host)
                and (accept is None or accept(cand.filled().for_blocks(layers))))

    # grad_buffers and bf16_grads resolved once: the placement does not change the host footprint they
    # depend on (but for offloaded inputs, decided first), and resolving them per candidate is most of the cost
    engine = dataclasses.replace(engine, **{f: getattr(resolve(shape, work, engine, hw, tried=True).engine, f)
                                            for f in ("grad_buffers", "bf16_grads")})
    given, best = engine, None
    # the updates on the device (update_on_device) where it is open and could apply: off, True (the part before
    # the blocks and the first block) and N blocks (N - 1 cached ones too, for a run the host AdamW bounds)
    could = work.accumulate == 1 and not work.clip and engine.host_state != "compact" and engine.overlap_optimizer
    for on in (device_update_options(layers) if could else [False]) if engine.update_on_device is None \
            else [engine.update_on_device]:
        engine = dataclasses.replace(given, update_on_device=on)
        offload = engine.offload_inputs
        if "offload_inputs" in unset:  # only where the streaming placement itself does not fit: the fewest that do
            streaming = dataclasses.replace(engine, keep_activations=0, cache_weights=0, offload_inputs=0).filled()
            offload = 0 if fits(streaming) else smallest_offload(shape, resolve(shape, work, streaming, hw, tried=True),
                                                                   budget, host)
            if offload is None:
                continue
        for saves in (["all", "matmuls"] if "kept_saves" in unset else [engine.kept_saves]):
            for slots in ([2, 3] if "slots" in unset else [engine.slots]):
                base = dataclasses.replace(engine, slots=slots, kept_saves=saves)
                keeps = range(layers, -1, -1) if "keep_activations" in unset else [engine.keep_activations]
                for keep in keeps:
                    cand = dataclasses.replace(base, keep_activations=keep, offload_inputs=offload)
                    if "cache_weights" in unset:
                        cand = dataclasses.replace(cand, cache_weights=keep)
                    if not fits(cand):
                        continue
                    if "cache_weights" in unset:  # the most cached weights that still fit (memory grows with them)
                        lo, hi = keep, layers
                        while lo < hi:
                            mid = (lo + hi + 1) // 2
                            lo, hi = (mid, hi) if fits(dataclasses.replace(cand, cache_weights=mid)) else (lo, mid - 1)
                        cand = dataclasses.replace(cand, cache_weights=lo)
                    cand = cand.filled()
                    run = resolve(shape, work, cand, hw, tried=True)
                    pinned_ok = pinned_bytes(shape, run) <= hw.pinned_budget_gb * GB
                    step = step_times(shape, run, hw, pinned_ok, HOST_MARGIN)["step"] * (1 + MATMULS_MARGIN * (saves == "matmuls"))
                    key = (step, gpu_peak(gpu_bytes(shape, run)))
                    if best is None or key < best[:2]:  # a tie: the less memory (the device update off)
                        best = (*key, cand)
    return best[2] if best is not None else given.filled()


def device_update_options(layers: int) -> list[bool | int]:
    """The ``update_on_device`` values a chosen placement weighs: off, True, and N blocks at a few sizes up to
    all of them (each N is timed with its memory counted; one more N costs the search ~0.03 s at 3B)."""
    return [False, True, *(n for n in (2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128) if n < layers), layers]


def placement_line(engine: EngineConfig, chosen: tuple[str, ...]) -> str:
    """One line naming the chosen fields and their values, for the log and the planner's table."""
    values = ", ".join(f"{f}={getattr(engine, f)}" for f in chosen)
    return (f"placement the planner predicts: {values} (the strategy chooses from its measured first step; set "
            "any of them under strategy.engine to choose it yourself)")
