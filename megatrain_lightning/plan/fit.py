"""The plan and the one fit check: will a run fit host and device memory, decided before allocating."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..config import EngineConfig, grad_buffers_for
from ..errors import ConfigError
from ..hardware import HardwareProfile
from .context import longest_context, smallest_offload
from .experts import host_bound_warning
from .memory import (
    GB, OFFLOADED, PROCESS, PROCESS_OVERHEAD_GB, STAGING, device_available, fits_memory, gpu_bytes, gpu_peak,
    grad_host_bytes, host_bytes, lasting_weights, pinned_bytes,
)
from .run import Run, Workload
from .shape import PlanShape
from .timing import bottleneck, step_times

# A strategy that keeps fp32 master, gradient and AdamW's two moments in host (or device) memory.
BASELINE_STATE_BYTES_PER_PARAM = 16


@dataclass(frozen=True)
class Plan:
    """The planner's answer: bytes by item, seconds by phase, the bottleneck, and the largest shapes."""

    model: str
    hardware: str
    shape: PlanShape
    run: Run
    host: dict[str, float]  # bytes by item
    host_total: float
    host_available: float
    pinned: float  # bytes page-locked (a subset of `host`)
    pinned_ok: bool  # within the profile's pinned budget (else pageable, ~8x slower copies)
    gpu: dict[str, float]  # bytes by item (the two transients listed; only the larger counts)
    gpu_total: float  # torch allocator peak: compare with max_memory_reserved
    gpu_available: float  # device memory less the CUDA context
    times: dict[str, float]  # seconds: per micro-batch resources, host AdamW, the step
    step_s: float
    bottleneck: str
    max_micro_batch: int  # at the run's seq_len
    max_seq_len: int  # at the run's micro-batch (device and host memory)
    needs_offload: int | None = None  # the fewest offload_inputs blocks this shape fits with (None: none fits)
    chosen: tuple[str, ...] = ()  # placement fields the planner chose (plan/placement.py)
    longest: Any = None  # plan.context.Context: the longest sequence at this micro-batch, offloading what it must
    moe_warning: str | None = None  # a mixture of experts bound by host work (plan/experts.py)
    picked: str | None = None  # the line saying the planner picked the micro-batch (from_config.planned_run)

    @property
    def tokens_per_s(self) -> float:
        return self.run.work.tokens * self.run.work.accumulate / self.step_s

    @property
    def fits(self) -> bool:
        return self.host_total <= self.host_available and self.gpu_total <= self.gpu_available


def resolve(shape: PlanShape, work: Workload, engine: EngineConfig, hw: HardwareProfile, tried: bool = False,
            **older: bool) -> Run:
    """``engine``'s automatic choices as the strategy will make them on ``hw``: ``grad_buffers`` by the one
    policy (``config.grad_buffers_for``), ``bf16_grads=None`` as on (the one-pass kernel assumed to build
    on the target). ``tried``: the strategy measures and tries its own placement (:class:`Run`'s field).
    ``older``: :class:`Run`'s ``compact_native`` / ``head_in_backward``."""
    engine = engine.filled().for_blocks(shape.layers)
    if engine.bf16_grads is None:
        engine = dataclasses.replace(engine, bf16_grads=True)
    if engine.grad_buffers is None:
        own = Run(work, dataclasses.replace(engine, grad_buffers=0), tried=tried, **older)
        pool = grad_buffers_for(None, sum(host_bytes(shape, own).values()), hw.host_memory_gb * GB)
        engine = dataclasses.replace(engine, grad_buffers=pool)
    return Run(work, engine, tried=tried, **older)


def _largest(shape: PlanShape, run: Run, available: float, field: str, limit: int,
             host_available: float | None = None) -> int:
    """Largest value of ``field`` (micro_batch or seq_len) that fits: memory grows with it."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits_memory(shape, run.replace(**{field: mid}), available, host_available):
            lo = mid
        else:
            hi = mid - 1
    return lo


def largest_micro_batch(shape: PlanShape, run: Run, available: float, limit: int = 1 << 14,
                        host_available: float | None = None) -> int:
    """Largest micro-batch at the run's seq_len that fits (0: not even one row)."""
    return _largest(shape, run, available, "micro_batch", limit, host_available)


def largest_seq_len(shape: PlanShape, run: Run, available: float, limit: int = 1 << 22,
                    host_available: float | None = None) -> int:
    """Largest sequence length at the run's micro-batch that fits the device (and the host, when
    ``host_available`` is given), rounded down to a multiple of 128. Every memory choice is the run's: the
    chunked MLP and loss, the offloaded blocks and the saved inputs' dtype (``plan.context`` also chooses
    how many blocks to offload)."""
    lo = _largest(shape, run, available, "seq_len", limit, host_available)
    return lo // 128 * 128 if lo >= 128 else lo


def make_plan(shape: PlanShape, run: Run, hw: HardwareProfile, model: str = "the model",
              refuse_host: bool = True, refuse_device: bool = True) -> Plan:
    """The plan for ``model`` on ``hw``; a ConfigError naming the numbers and the fix when host
    (``refuse_host``) or device (``refuse_device``) memory is short."""
    host = host_bytes(shape, run)
    host_total = sum(host.values())
    host_available = hw.host_memory_gb * GB
    if refuse_host and host_total > host_available:
        state = host_total - host[STAGING] - host[OFFLOADED] - host[PROCESS]
        refuse_host_memory(
            model, shape.total_params, host_total, hw,
            f"{state / GB:,.1f} GB of master, gradient and AdamW state at {state / shape.total_params:.1f} "
            f"B/param, {(host_total - state) / GB:.1f} GB staging and process",
            compact_need=compact_host_bytes(shape, run),
            placed_needs=(sum(host_bytes(shape, run.replace(tried=False)).values()),
                          compact_host_bytes(shape, run.replace(tried=False))) if run.tried else None,
        )
    pinned = pinned_bytes(shape, run)
    pinned_ok = hw.accelerator == "cuda" and pinned <= hw.pinned_budget_gb * GB
    gpu = gpu_bytes(shape, run)
    gpu_total = gpu_peak(gpu)
    gpu_available = device_available(hw)
    max_mb = largest_micro_batch(shape, run, gpu_available, host_available=host_available)
    max_seq = largest_seq_len(shape, run, gpu_available, host_available=host_available)
    needs_offload = smallest_offload(shape, run, gpu_available, host_available)
    if refuse_device and gpu_total > gpu_available:
        raise ConfigError(device_shortfall(model, run, gpu_total, gpu_available, hw, max_mb, max_seq, gpu,
                                           offload=needs_offload))
    times = step_times(shape, run, hw, pinned_ok or hw.accelerator != "cuda")
    return Plan(
        model=model, hardware=hw.name, shape=shape, run=run,
        host=host, host_total=host_total, host_available=host_available, pinned=pinned, pinned_ok=pinned_ok,
        gpu=gpu, gpu_total=gpu_total, gpu_available=gpu_available,
        times=times, step_s=times["step"], bottleneck=bottleneck(times),
        max_micro_batch=max_mb, max_seq_len=max_seq,
        needs_offload=needs_offload,
        longest=longest_context(shape, run, hw),
        moe_warning=host_bound_warning(shape, run, hw, times, max_mb, pinned_ok or hw.accelerator != "cuda", model),
    )


def compact_host_bytes(shape: PlanShape, run: Run) -> float | None:
    """Host bytes of the same run with ``host_state="compact"``; None when it already is."""
    if run.engine.host_state == "compact":
        return None
    return sum(host_bytes(shape, run.replace(host_state="compact")).values())


def ways_to_fit(plan: Plan) -> list[str]:
    """The changes, each on its own, that make a plan that does not fit fit (none when it fits)."""
    ways = []
    if plan.host_total > plan.host_available:
        compact = compact_host_bytes(plan.shape, plan.run)
        if compact is not None and compact <= plan.host_available:
            ways.append(f"strategy.engine.host_state=compact ({compact / GB:,.1f} GB of host memory)")
        ways.append(f"a host with {plan.host_total / GB:,.0f} GB or more (hardware.host_memory_gb=... if the profile "
                    "understates this machine)")
    if plan.gpu_total > plan.gpu_available:
        w = plan.run.work
        if plan.max_micro_batch:
            ways.append(f"data.batch_size={plan.max_micro_batch} (or less) at seq {w.seq_len}, with "
                        "trainer.accumulate_grad_batches for the tokens per step")
        if plan.max_seq_len:
            ways.append(f"sequences of {plan.max_seq_len} tokens (or fewer) at micro-batch {w.micro_batch}")
        if not plan.max_micro_batch and not plan.max_seq_len:
            ways.append("a device with more memory, or fewer strategy.engine.slots")
    return ways


def device_shortfall(model: str, run: Run, need: float, available: float, hw: HardwareProfile, max_mb: int,
                     max_seq: int, gpu: dict[str, float], offload: int | None = None) -> str:
    """What to change when the device peak does not fit, in one paragraph. ``offload``: the fewest
    offloaded blocks with which this shape fits (None: no count does)."""
    w = run.work
    return (
        f"model={model} at micro-batch {w.micro_batch} x {w.seq_len} tokens needs {need / GB:.1f} GB of "
        f"device memory but hardware={hw.name} has {available / GB:.1f} GB for tensors: "
        + (f"set strategy.engine.offload_inputs={offload} (the first {offload} blocks' saved inputs in pinned host "
           "memory), or " if offload is not None else "")
        + (
            "use " + " or ".join(([f"at most data.batch_size={max_mb} at this seq_len"] if max_mb else [])
                                 + ([f"data.seq_len={max_seq} at this micro-batch"] if max_seq else []))
            + " (and trainer.accumulate_grad_batches for more tokens per step), or set model.loss_chunk_tokens"
            if max_mb or max_seq
            else f"even one row does not fit ({lasting_weights(gpu) / GB:.1f} GB are weight slots, gradient slabs "
            f"and resident parameters): choose a device with more memory or fewer strategy.engine.slots"
        )
    )


def refuse_host_memory(model: str, num_params: int, need: float, hw: HardwareProfile, what: str,
                       compact_need: float | None = None,
                       placed_needs: tuple[float, float | None] | None = None) -> None:
    """The one host fit refusal: a ConfigError with the numbers and what to change. ``compact_need``: the host
    bytes with ``host_state=compact`` (None: not an option, or already chosen). ``placed_needs``: where the
    strategy would measure and try its own placement (``Run.tried``), the bytes with the placement set by hand,
    as it is and compact."""
    available = hw.host_memory_gb * GB
    placed, placed_compact = placed_needs or (None, None)
    fields = ("the placement fields (strategy.engine.slots, keep_activations, kept_saves, cache_weights, "
              "offload_inputs: no step is then measured or tried, whose fp32 gradients are the peak)")
    if compact_need is not None and compact_need <= available:
        first = (f"set strategy.engine.host_state=compact, which needs {compact_need / GB:,.1f} GB and fits "
                 f"(4 B/param less; docs/compact_state.md), or choose a smaller model")
    elif placed is not None and placed <= available:
        first = f"set {fields}, which needs {placed / GB:,.1f} GB and fits, or choose a smaller model"
    elif placed_compact is not None and placed_compact <= available:
        first = (f"set strategy.engine.host_state=compact (docs/compact_state.md) and {fields}: "
                 f"{placed_compact / GB:,.1f} GB, which fits; or choose a smaller model")
    elif compact_need is not None:
        first = (f"choose a smaller model (strategy.engine.host_state=compact is not enough: it still needs "
                 f"{compact_need / GB:,.1f} GB)")
    else:
        first = "choose a smaller model"
    raise ConfigError(
        f"model={model} ({num_params / 1e9:.2f} B parameters) needs {need / GB:,.1f} GB of host memory ({what}), "
        f"but hardware={hw.name} has {hw.host_memory_gb:,.0f} GB: {first}, or a host with {need / GB:,.0f} GB or "
        f"more (set hardware.host_memory_gb if the profile is wrong for this machine)"
    )


def check_baseline_host(model: str, num_params: int, hw: HardwareProfile) -> float:
    """A CPU-offload baseline (DeepSpeed, FSDP) keeps 16 B/param on the host: refuse what cannot fit.
    Returns the bytes."""
    need = num_params * BASELINE_STATE_BYTES_PER_PARAM + PROCESS_OVERHEAD_GB * GB
    if need > hw.host_memory_gb * GB:
        refuse_host_memory(model, num_params, need, hw, "fp32 master, gradient and 2 AdamW moments, 16 B/param, "
                           "and the process")
    return need


def device_state_warning(num_params: int, device_memory_gb: float, strategy: str) -> str | None:
    """For a strategy that keeps all training state on the device: a warning when it cannot fit.

    Not an error: the sweep is where one finds out, and its table records the out-of-memory.
    """
    need = num_params * BASELINE_STATE_BYTES_PER_PARAM
    if need <= device_memory_gb * GB:
        return None
    return (
        f"strategy={strategy} keeps {BASELINE_STATE_BYTES_PER_PARAM} B/param of training state on the device: "
        f"{need / GB:,.0f} GB > {device_memory_gb:,.0f} GB of device memory; expect an out-of-memory error"
    )


def setup_shape(total_params: int, block_sizes: list[int], trainable_params: int | None = None,
                frozen_bytes: float = 0.0) -> PlanShape:
    """Counts of a module about to be streamed, for the host check at setup (any module: widths unknown)."""
    blocks = sum(block_sizes)
    return PlanShape(total_params=total_params, block_params=blocks, largest_block=max(block_sizes, default=0),
                     resident_params=total_params - blocks, head_params=0, layers=len(block_sizes), heads=1,
                     head_dim=1, kv_dim=1, hidden=1, intermediate=1, vocab=1, trainable_params=trainable_params,
                     frozen_bytes=frozen_bytes)


def check_host_at_setup(model: str, shape: PlanShape, engine: EngineConfig, accumulate: int, clip: bool,
                        released_bytes: float, available_bytes: float, limit_note: str,
                        ranks_per_node: int = 1, tmpfs: tuple[str, float] | None = None) -> float:
    """Before the host store is built: refuse when its masters, gradients and Adam moments cannot fit in the
    host memory this process may still take (``available_bytes``: MemAvailable, or its cgroup's headroom),
    with the numbers and what to change. ``released_bytes``: the host parameter tensors the store replaces.
    With ``grad_buffers=None`` the smaller footprint (a pool) is checked: the engine takes its own
    accumulators only where they fit. ``ranks_per_node`` > 1 (data parallel): the node's ranks share one
    store (masters, frozen weights, moments) and each holds its own gradients and staging; that store lives
    in ``tmpfs`` (its directory, free bytes), checked too: a tmpfs that runs out mid-write kills the process
    (SIGBUS) rather than raising. Returns the bytes needed."""
    engine = engine.filled()
    if engine.grad_buffers is None:
        engine = dataclasses.replace(engine, grad_buffers=4)
    run = Run(Workload(micro_batch=1, seq_len=1, accumulate=accumulate, bf16=False, clip=clip),
              dataclasses.replace(engine, bf16_grads=False))
    items = host_bytes(shape, run)
    need = sum(items.values()) - items[PROCESS] - items[OFFLOADED] - released_bytes  # the process already runs
    per_rank = grad_host_bytes(shape, run) + items[STAGING] - released_bytes
    if tmpfs is not None and ranks_per_node > 1:
        shared = sum(items.values()) - grad_host_bytes(shape, run) - items[STAGING] - items[OFFLOADED] - items[PROCESS]
        if shared > tmpfs[1]:
            raise ConfigError(
                f"MegaTrainStrategy (data parallel): {model}'s host store, one per node ({shared / GB:,.1f} GB: "
                f"masters, frozen weights and AdamW moments), lives in {tmpfs[0]}, which has only {tmpfs[1] / GB:,.1f} "
                "GB free: give the container a larger /dev/shm (docker run --shm-size=...), or point "
                "$MEGATRAIN_SHM_DIR at a tmpfs with room for it"
            )
    need += (ranks_per_node - 1) * per_rank  # the node's other ranks (already running too)
    if need > available_bytes:
        per_param = (need + ranks_per_node * released_bytes) / max(shape.total_params, 1)
        shared_note = (f"; one copy shared by this node's {ranks_per_node} ranks, gradients per rank"
                       if ranks_per_node > 1 else "")
        compact = (", EngineConfig(host_state='compact') (strategy.engine.host_state=compact in train.py: 4 B/param "
                   "less)" if engine.host_state != "compact" else "")
        raise ConfigError(
            f"MegaTrainStrategy: {model} has {shape.total_params / 1e9:.3f} B parameters, whose host store (fp32 "
            f"masters, gradients and AdamW moments, {per_param:.1f} B/param{shared_note}) needs {need / GB:,.1f} GB more host "
            f"memory, but this process may take only {available_bytes / GB:,.1f} GB ({limit_note}): choose a smaller "
            f"model{compact}, free host memory, or run on a machine with more of it"
        )
    return need
