"""The placement chosen from a measured step: what ``MegaTrainStrategy`` does when its placement is left open.

The first micro-batch of a run streams (nothing kept or cached: ``config.STREAMING``) and the engine measures
it (``StreamingEngine.measure_next``): its device peak ``P``, which includes whatever the user's step holds
(its loss and logits, a metric's buffers), and the largest graph one recompute built, ``G``: what keeping one
block's activations adds. One block's weights in a fixed slot, ``W``, are known exactly. A placement that
keeps ``k`` blocks and caches ``c >= k`` is then predicted to peak at ``P + k·G + c·W`` (plus ``W`` per slot
beyond two): an upper bound, since ``P`` already holds one recompute's graph and the kept blocks' saved inputs.
The budget is :data:`~.placement.HEADROOM` of the device bytes usable when the engine was built.

Which placement: where the model's shapes are known (a Hugging Face model in the module), the planner's
choice (``placement.choose_placement``) for the measured micro-batch, on a budget less what the measured peak
holds beyond the planner's own prediction of the streaming step (the user's loss and logits), among the
candidates whose measured prediction fits (the fastest of them, not the planner's first choice with kept
blocks taken away); selective saves cost ``G`` scaled by the planner's ratio of matmul outputs to all
activations. Without shapes: as many kept blocks as fit with their weights cached, then as
many more cached weights as fit. Fields the user set are never changed.

The next micro-batch, on the chosen placement, is measured too: a peak above the budget moves ``P`` up by
what the prediction missed and the placement is clamped again (:func:`back_off`); running out of memory
halves what the placement added to the streaming step (:func:`after_out_of_memory`), down to streaming,
which the first step showed fits. Running out also says what the device really gives this process (the
bytes its allocator held then): from then on the budget is at most :data:`~.placement.HEADROOM` of that, and
a tried step is held to it by the memory it reserved (fragmentation included), not only by what its tensors
held. A mixture of experts the chosen placement leaves bound by host work gets the planner's warning, in a
Lightning user's words (:func:`moe_warning`). Lightning-free, CUDA-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from ..config import EngineConfig
from ..hardware import HardwareProfile
from .experts import LIGHTNING, host_bound_warning
from .fit import largest_micro_batch, resolve
from .memory import GB, block_activations_per_token, gpu_bytes, gpu_peak, kept_matmul_outputs_per_token
from .placement import HEADROOM, HOST_MARGIN, choose_placement
from .run import Workload, device_blocks
from .shape import PlanShape
from .timing import step_times


@dataclass(frozen=True)
class Measured:
    """A measured streaming micro-batch and the device it ran on, in bytes."""

    peak: float  # P: the streaming micro-batch's device peak
    kept_graph: float  # G: one block's activations, kept
    block_weights: float  # W: one (the largest) block's weights in the compute dtype
    budget: float  # what a placement may plan for
    layers: int
    matmuls_ratio: float | None = None  # G under kept_saves="matmuls" over G; None: not offered
    capacity: float = 0.0  # what the allocator held when a step ran out of device memory; 0: none has
    device_moments: float = 0.0  # what the updates on the device keep there (update_on_device: moments, first block)
    device_block_moments: float = 0.0  # and each further block updated there (update_on_device=N: 12 B/param)

    def predicted_peak(self, e: EngineConfig) -> float:
        ratio = (self.matmuls_ratio or 1.0) if e.kept_saves == "matmuls" else 1.0
        graph = self.kept_graph * ratio
        extra_slots = max((e.slots or 2) - 2, 0)
        blocks = device_blocks(e, self.layers)  # not in the measured (host-updated) steps
        moments = self.device_moments + (blocks - 1) * self.device_block_moments if blocks else 0.0
        return self.peak + (e.keep_activations or 0) * graph + (e.cached_blocks + extra_slots) * self.block_weights + moments

    def fits(self, e: EngineConfig) -> bool:
        return self.predicted_peak(e) <= self.budget


def clamp(m: Measured, e: EngineConfig, unset: tuple[str, ...]) -> EngineConfig:
    """``e`` with, among the ``unset`` fields, extra slots, then cached weights beyond the kept blocks, then kept
    blocks, then the updates on the device taken away until the measured prediction fits (or
    nothing chosen is left). :func:`by_planner` weighs the last two by the planner's step time."""
    while not m.fits(e):
        if "slots" in unset and e.slots > 2:
            e = dataclasses.replace(e, slots=2)
        elif "cache_weights" in unset and e.cache_weights > e.keep_activations:
            e = dataclasses.replace(e, cache_weights=e.cache_weights - 1)
        elif "keep_activations" in unset and e.keep_activations > 0:
            k = e.keep_activations - 1
            e = dataclasses.replace(e, keep_activations=k, cache_weights=min(e.cache_weights, k)
                                    if "cache_weights" in unset else e.cache_weights)
        elif "update_on_device" in unset and e.update_on_device:  # their state off the device
            e = dataclasses.replace(e, update_on_device=False)
        else:
            break
    return e


def _largest(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with ok(n), ok monotone (lo assumed ok)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def by_measurement(m: Measured, engine: EngineConfig) -> EngineConfig:
    """Without the model's shapes: the most kept blocks (all their activations) that fit with their weights
    cached, then the most cached weights."""
    unset = engine.unset
    e = engine.filled()
    if "keep_activations" in unset:
        def keep_fits(k: int) -> bool:
            c = max(k, e.cache_weights) if "cache_weights" not in unset else k
            return m.fits(dataclasses.replace(e, keep_activations=k, cache_weights=c))
        k = _largest(keep_fits, 0, m.layers) if keep_fits(0) else 0
        e = dataclasses.replace(e, keep_activations=k, cache_weights=k if "cache_weights" in unset else e.cache_weights)
    if "cache_weights" in unset:
        k = e.keep_activations
        e = dataclasses.replace(e, cache_weights=_largest(
            lambda c: m.fits(dataclasses.replace(e, cache_weights=c)), k, m.layers) if m.fits(e) else k)
    return clamp(m, e, unset)


def by_planner(m: Measured, engine: EngineConfig, shape: PlanShape, work: Workload, hw: HardwareProfile
               ) -> tuple[EngineConfig, float]:
    """With the model's shapes: the planner's choice on the budget less what the measured streaming peak holds
    beyond the planner's prediction of it, among the candidates the measured prediction accepts (then clamped to
    it, for the fields the planner does not search); and its predicted step time."""
    planned = choose_placement(shape, work, engine, hw, budget=planner_budget(m, engine, shape, work, hw), accept=m.fits)
    return fastest_fit(m, planned, engine.chosen_with_placement, shape, work, hw)


def predicted_first_step(shape: PlanShape, work: Workload, engine: EngineConfig, hw: HardwareProfile) -> Measured:
    """The streaming first step as the planner predicts the strategy will measure it on ``hw``: its peak, a kept
    block's activations, one block's weights, :data:`HEADROOM` of the device, the moments the updates on the device
    add (``engine/device_update.device_moment_bytes``' rule). For planning the placement :func:`by_planner` will
    reach from the measured step (``from_config.moe_micro_batch``: a mixture of experts, whose routed experts'
    activations the planner models as measured on the GPU, ``memory.ROUTED_ROW_ALL``)."""
    from ..engine.compiled import COMPILED_MATMULS_RATIO
    from .memory import device_available

    # the strategy's ratio: a compiled kept block saving matmul outputs, unless its experts run between two graphs
    compiled = work.bf16 if engine.compile_blocks is None else engine.compile_blocks
    whole = compiled and (shape.routing_inside or shape.active_fraction >= 1.0)
    streaming = resolve(shape, work, engine.filled(), hw)
    scale = 1 if work.bf16 else 2
    block = shape.block_params / max(shape.layers, 1)
    before = 0 if engine.host_state == "compact" else 8 * (shape.resident_params - shape.untied_head())
    return Measured(peak=gpu_peak(gpu_bytes(shape, streaming)),
                    kept_graph=work.tokens * scale * block_activations_per_token(shape, work.mlp_chunked),
                    block_weights=(2 if work.bf16 else 4) * shape.largest_block,
                    budget=HEADROOM * device_available(hw), layers=shape.layers,
                    device_moments=before + 12 * block + 4 * shape.largest_block, device_block_moments=12 * block,
                    matmuls_ratio=COMPILED_MATMULS_RATIO if whole else matmuls_ratio(shape))


def planner_budget(m: Measured, engine: EngineConfig, shape: PlanShape, work: Workload, hw: HardwareProfile) -> float:
    """The device bytes the planner's own byte counts may fill: the measured budget less what the measured
    streaming step held beyond the planner's prediction of it (the user's loss and logits, the planner's error)."""
    streaming = resolve(shape, work, engine.filled(), hw)
    return m.budget - (m.peak - gpu_peak(gpu_bytes(shape, streaming)))


def fastest_fit(m: Measured, planned: EngineConfig, unset: tuple[str, ...], shape: PlanShape, work: Workload,
                hw: HardwareProfile) -> tuple[EngineConfig, float]:
    """``planned`` clamped to the measured prediction, and with the updates on the device on the first block only
    (where it asks for N) or off first, where they are on and open: whichever the planner times faster; and its
    step time."""
    options = [clamp(m, planned, unset)]
    if planned.update_on_device and "update_on_device" in unset:
        if int(planned.update_on_device) > 1:  # N blocks: their memory may be worth more as kept blocks
            options.append(clamp(m, dataclasses.replace(planned, update_on_device=True), unset))
        options.append(clamp(m, dataclasses.replace(planned, update_on_device=False), unset))
    runs = [resolve(shape, work, e, hw) for e in options]
    _, best = min((step_times(shape, r, hw, host_margin=HOST_MARGIN)["step"], i) for i, r in enumerate(runs))
    return options[best], step_times(shape, runs[best], hw)["step"]  # chosen with the margin, predicted without


def moe_warning(m: Measured, requested: EngineConfig, chosen: EngineConfig, shape: PlanShape, work: Workload,
                hw: HardwareProfile, model: str = "The model") -> str | None:
    """A mixture of experts bound by the host or the link on the placement chosen from the measured step: the
    planner's warning (``experts.host_bound_warning``) in a Lightning user's words, with the largest micro-batch
    the planner fits in the budget ``by_planner`` chose on (:func:`planner_budget`); None for a dense model or a
    compute-bound step."""
    if shape.active_fraction >= 1.0:
        return None
    run = resolve(shape, work, chosen, hw)
    budget = planner_budget(m, requested, shape, work, hw)
    holds = largest_micro_batch(shape, run, budget, host_available=hw.host_memory_gb * GB)
    return host_bound_warning(shape, run, hw, step_times(shape, run, hw), holds, model=model, words=LIGHTNING)


def matmuls_ratio(shape: PlanShape) -> float:
    """What a kept block holds with ``kept_saves="matmuls"`` over all its activations (the planner's model)."""
    return kept_matmul_outputs_per_token(shape) / block_activations_per_token(shape)


def back_off(m: Measured, e: EngineConfig, peak: float, unset: tuple[str, ...]) -> tuple[Measured, EngineConfig]:
    """The micro-batch on ``e`` peaked at ``peak``: what the prediction missed goes into the measured base, and
    ``e`` is clamped again (unchanged when it still fits)."""
    missed = max(peak - m.predicted_peak(e), 0.0)
    m = dataclasses.replace(m, peak=m.peak + missed)
    return m, clamp(m, e, unset)


def after_out_of_memory(m: Measured, e: EngineConfig, unset: tuple[str, ...], held: float = 0.0
                        ) -> tuple[Measured, EngineConfig]:
    """``e`` ran out of device memory with ``held`` bytes reserved by the allocator (0: unknown): a budget that
    halves what it added to the streaming step, and at most :data:`HEADROOM` of the smallest ``held`` seen;
    at the last, the streaming placement itself (the measured step ran on it)."""
    added = m.predicted_peak(e) - m.peak
    capacity = min((c for c in (m.capacity, held) if c > 0), default=0.0)
    budget = m.peak + added / 2
    if capacity > 0:
        budget = min(budget, HEADROOM * capacity)
    m = dataclasses.replace(m, budget=budget, capacity=capacity)
    smaller = clamp(m, e, unset)
    if smaller == e:  # nothing left to take away but the whole choice
        smaller = dataclasses.replace(e, **{f: None for f in unset}).filled()
    return m, smaller
