"""Mixture of experts: the device computes on the active experts, the host works on all of them.

A token passes through ``experts_per_token / num_experts`` of a block's expert weights, so the device FLOPs
of a step fall by about that ratio (gpt-oss-20b: 4 of 32 experts, 21% of its block parameters active),
while everything MegaTrainStrategy does per parameter stays: the weights cross the link twice per
micro-batch (forward and recompute), the gradients once, and the host AdamW updates every expert every step
(an expert without tokens still decays, as in native AdamW). A run that a dense model of the same size would
keep compute-bound then waits on the host or the link. More tokens hide that work: the copies are paid per
micro-batch (a larger micro-batch), the host update per step (accumulation too).

:func:`host_bound_warning` says so, with the workload that would make device compute the busiest resource
again (by the same step model, ``timing.py``); the plan carries it, its report and ``train.py`` print it.

Where the micro-batch is left to the hardware profile, the planner picks it for a mixture of experts
(:func:`pick_micro_batch`, applied to a config by ``from_config.moe_micro_batch``): the work per step on every
parameter (the host AdamW, the device's update of what it holds, the copies) is spread over more tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..hardware import HardwareProfile
from .memory import GB, host_bytes
from .run import Run
from .shape import PlanShape
from .timing import bottleneck, step_times

COPIES = ("host->device copies", "device->host copies")


@dataclass(frozen=True)
class Words:
    """How a warning names what to set: train.py's config keys (:data:`TRAIN_PY`) or, said by the strategy after a
    run's first micro-batch, a Lightning user's own arguments (:data:`LIGHTNING`). Each is formatted with ``n``;
    an empty ``placement`` leaves out the clause that names it."""

    batch: str = "data.batch_size={n}"
    seq: str = "data.seq_len={n}"
    accumulate: str = "trainer.accumulate_grad_batches={n}"
    compact: str = "strategy.engine.host_state=compact"
    placement: str = "strategy.engine.cache_weights or keep_activations"
    host: str = "hardware={n}'s"
    same_length: str = "at this seq_len"


TRAIN_PY = Words()
# (no placement clause: the strategy has just filled its budget with cached weights and kept activations)
LIGHTNING = Words(batch="a batch_size of {n}", seq="{n} tokens per row", accumulate="Trainer(accumulate_grad_batches={n})",
                  compact='EngineConfig(host_state="compact")', placement="", host="this machine's",
                  same_length="at this sequence length")


def host_bound_warning(shape: PlanShape, run: Run, hw: HardwareProfile, times: dict[str, float],
                       max_micro_batch: int, pinned_ok: bool = True, model: str = "the model",
                       words: Words = TRAIN_PY) -> str | None:
    """A warning when a mixture of experts (``shape.active_fraction < 1``) is bound by the host optimizer or
    the link rather than device compute, naming the ratio, the resource and the tokens per step that would
    hide it; None otherwise.

    The workload it names: the smallest micro-batch (at the run's seq_len and accumulation) whose device
    compute covers the copies and the host update, where the device holds it; else the largest the device
    holds, and the accumulation that covers the host update (each further micro-batch adds one host
    accumulation, 12 of AdamW's 28 B/param), with what stays exposed (copies the device cannot hold the
    micro-batch to hide, host memory that accumulation's own fp32 accumulators would need), in ``words``.
    """
    busy = bottleneck(times)
    if shape.active_fraction >= 1.0 or busy == "compute":
        return None
    w = run.work
    everything = (*COPIES, "host optimizer")

    def hidden(micro_batch: int, accumulate: int, what: tuple[str, ...]) -> bool:
        t = step_times(shape, run.replace(micro_batch=micro_batch, accumulate=accumulate), hw, pinned_ok)
        return t["device compute"] >= max(t[k] for k in what)

    resource = busy if busy == "host optimizer" else f"{busy} copies"
    head = (f"{model} is a mixture of experts: a token passes through {shape.active_fraction:.0%} of the block "
            f"parameters ({shape.active_blocks / 1e9:.2f} of {shape.block_params / 1e9:.2f} B), so the device "
            f"computes on those while the host AdamW and the copies work on all of them: at "
            f"{w.tokens * w.accumulate:,} tokens per step the step is bound by the {resource} "
            f"({times[resource]:.3f} s against {times['device compute']:.3f} s of device compute). ")
    holds = max(max_micro_batch, w.micro_batch)
    both = _smallest(w.micro_batch, lambda mb: hidden(mb, w.accumulate, everything))
    if both is not None and both <= holds:
        return head + (f"About {both * w.seq_len * w.accumulate:,} tokens per step would hide the host work: "
                       f"{words.batch.format(n=both)} at {words.seq.format(n=w.seq_len)}")
    copies = _smallest(w.micro_batch, lambda mb: hidden(mb, w.accumulate, COPIES))
    micro_batch = holds if copies is None else min(copies, holds)
    accumulate = _smallest(w.accumulate, lambda a: hidden(micro_batch, a, ("host optimizer",)), limit=1 << 16)
    if accumulate is None:
        out = head + f"At {words.batch.format(n=micro_batch)} no accumulation hides the host update"
    else:
        out = head + (f"About {micro_batch * w.seq_len * accumulate:,} tokens per step would hide the host update: "
                      f"{words.batch.format(n=micro_batch)} at {words.seq.format(n=w.seq_len)} with "
                      f"{words.accumulate.format(n=accumulate)} (the copies are paid per micro-batch, the "
                      f"host update per step)")
        longer = run.replace(micro_batch=micro_batch, accumulate=accumulate)
        need, have = sum(host_bytes(shape, longer).values()), hw.host_memory_gb * GB
        if accumulate > 1 and need > have:
            out += (f"; but accumulating keeps an fp32 gradient accumulator per parameter: {need / GB:,.0f} GB of "
                    f"host memory, over {words.host.format(n=hw.name)} {have / GB:,.0f} GB ({words.compact} "
                    f"needs less)")
    if copies is None or copies > holds:
        out += (f"; the copies stay exposed: the device holds at most {words.batch.format(n=holds)} {words.same_length}"
                + (f", hiding them takes {words.batch.format(n=copies)}" if copies is not None else "")
                + (f" ({words.placement} cut them)" if words.placement else ""))
    return out


# The micro-batch picked for a mixture of experts: the smallest whose planned tokens/s is within PICK_FRACTION of
# the best the device holds among the hardware profile's micro-batch to PICK_MAX_FACTOR times it. Past that the
# throughput grows slowly (the work per step is already spread) while the optimizer takes fewer, larger steps.
PICK_FRACTION = 0.9
PICK_MAX_FACTOR = 8


def pick_micro_batch(tokens_per_s: Callable[[int], float | None], base: int) -> tuple[int, dict[int, float]]:
    """The smallest micro-batch >= ``base`` whose ``tokens_per_s`` is at least PICK_FRACTION of the best over
    ``base`` .. PICK_MAX_FACTOR x ``base``; ``tokens_per_s(mb)`` is None where ``mb`` does not fit the device (the
    search stops at the first). Returns it and the rates planned (``base`` when none fits)."""
    rates: dict[int, float] = {}
    for mb in range(base, PICK_MAX_FACTOR * base + 1):
        rate = tokens_per_s(mb)
        if rate is None:
            break
        rates[mb] = rate
    if not rates:
        return base, rates
    best = max(rates.values())
    return min(mb for mb, r in rates.items() if r >= PICK_FRACTION * best), rates


def plan_note(shape: PlanShape) -> str:
    """The plan report's one line on the active parameters ('' for a dense model)."""
    if shape.active_fraction >= 1.0:
        return ""
    return (f"mixture of experts: {shape.active_blocks / 1e9:.3f} B of {shape.block_params / 1e9:.3f} B block params "
            f"active per token ({shape.active_fraction:.1%}): device FLOPs on those, copies and host AdamW on all")


def _smallest(start: int, ok: Callable[[int], bool], limit: int = 1 << 24) -> int | None:
    """The smallest n >= start with ok(n), for ok monotone in n (doubling, then bisection); None past limit."""
    hi = start
    while not ok(hi):
        if hi >= limit:
            return None
        hi *= 2
    lo = start
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if not ok(mid) else (lo, mid)
    return hi
