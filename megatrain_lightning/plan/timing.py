"""Step time of one MegaTrainStrategy run from the hardware's ceilings and the overlap condition.

Two rates are set by measured whole-model runs (the block compute by hidden size, the host AdamW inside a step;
see their constants); recipes/results/2026-11-30-planner-vs-measured.md compares the rest:
each phase takes as long as its slowest resource (device compute, host->device copies, device->host
copies), and the host AdamW runs beside the last backward and, running on, into the next forward.
"""

from __future__ import annotations

from ..hardware import HardwareProfile
from .memory import GB, saved_input_bytes
from .run import Run
from .shape import PlanShape

# Fraction of the profile's bf16 matmul peak that a dense transformer block's forward + backward reaches, by
# hidden size. A block's matmul FLOPs grow as hidden^2 per token, the memory-bound work beside them (norms,
# rotary, SwiGLU, residual adds) as hidden, so the rate falls toward small models: E / (1 + H0 / hidden).
# DESIGN.md §2: one Llama-7B-shaped layer alone, ~460 / ~510 / ~505 TFLOPS of real work at 2 K / 8 K / 16 K
# tokens against the 803 TFLOPS matmul ceiling (0.57-0.64). Two whole-model runs on the H200 set E and H0:
# Qwen2.5-7B (hidden 3584) at 0.60 (plain HF, 16 x 2048: this model within 1.7 %, 2026-12-03 session 9) and
# Qwen2.5-3B (hidden 2048) at 0.51 (its device-bound step with update_on_device=8, keep 33: 0.811 s against the
# 0.680 s that 0.60 gives; recipes/results/2026-12-03-h200-session11.md). Both ran before 2026-12-03's stream-order
# fix of the device update; after it, with the updated state kept on the device (2026-12-04), the 3B default runs
# 0.801 s against 0.794 s planned and the 7B plain HF default 3.631 against 3.601 (session 13): not re-fit.
MATMUL_EFFICIENCY_MAX = 0.784
MATMUL_EFFICIENCY_HIDDEN = 1100
# The same with the blocks compiled (``compile_blocks``: inductor fuses the elementwise work, so less of it is
# left beside the matmuls), fit the same way on the two whole-model H200 runs of 2026-12-04 with everything
# chosen by the strategy (recipes/results/2026-12-04-h200-session14.md): Qwen2.5-3B plain HF, 8 x 2048, 0.647 s
# against the 0.787 s the eager rate gives (0.62 at 2048), and the Qwen2.5-7B CausalLM, 16 x 2048, 2.772 s
# against 3.248 s (0.70 at 3584).
COMPILED_EFFICIENCY_MAX = 0.856
COMPILED_EFFICIENCY_HIDDEN = 780


def matmul_efficiency(hidden: int, compiled: bool = False) -> float:
    """The fraction of the bf16 peak a dense block of this hidden size computes at (0.60 at 3584, 0.51 at 2048;
    compiled: 0.70 and 0.62)."""
    if compiled:
        return COMPILED_EFFICIENCY_MAX / (1 + COMPILED_EFFICIENCY_HIDDEN / max(hidden, 1))
    return MATMUL_EFFICIENCY_MAX / (1 + MATMUL_EFFICIENCY_HIDDEN / max(hidden, 1))


# Causal attention (the scores under the diagonal) against the same bf16 peak, in the FLOPs counted here
# (forward 2·H·Q·T per token and layer, its recompute, twice that in the backward). One Qwen2.5-7B layer on
# the H200 (recipes/results/2026-12-02-h200-session5.md, SDPA's cuDNN kernel, the matmuls taken out at
# matmul_efficiency): 0.54 at 128 K tokens, 0.56 at 256 K. The FlashAttention-2 kernel that SDPA takes at
# short sequences runs slower (0.34 at 256 K), but there attention is a few percent of the step.
ATTENTION_EFFICIENCY = 0.55
# Mixture of experts: device seconds per routed (token, expert) row and hidden element, per pass (forward,
# recompute, and the backward as two), for what the routing does beside the matmuls: sorting the rows, the
# gathers and scatters of experts_implementation="grouped_mm_gather", the gate's elementwise work, the weighted
# sum. Fit on two whole-model H200 runs of 2026-12-03 (recipes/results/2026-12-03-h200-session12.md), the
# device time beyond this model's matmuls and attention: GPT-OSS-20B, 4 layers at 34 x 2048 (profiled compute busy
# 1.768 s against 1.285 s: 0.48 s over 3.2 G routed row-elements x 3.5 passes, 4.3e-11) and Qwen3-30B-A3B, 6
# layers at 28 x 2048 (a 1.42 s step against 0.71 s: 0.71 s over 5.6 G x 3.33, 3.8e-11). Both ran before that
# day's stream-order fix, which changed when copies go home, not the device's work.
ROUTED_SECONDS_PER_ELEMENT = 4.0e-11
# The same for experts compiled inside their block's graph (``PlanShape.routing_inside``: grouped GEMM experts
# without biases, blocks compiled), inductor fusing the gathers, casts and weighting with the norms and attention:
# fit on Qwen3-30B-A3B cut to 10 layers, 8 x 2048, everything chosen by the strategy (H200, 2026-12-05,
# recipes/results/2026-12-05-session20.md: 0.319 s/step, keep 9 of 10, every block updated on the device), the
# step less this model's matmuls, attention and device update. GPT-OSS's experts (biases) stay eager between two
# graphs and keep the rate above (its 7-layer run of the same day: 0.964 s measured, 0.885 s planned). The compiled
# matmul rate above was fit before the device's update was counted, on runs whose device updated a few blocks: at
# their placements the host's work sets the step, and their plans are unchanged (0.684 and 2.785 s); the eager rates'
# fit runs were not re-checked.
ROUTED_SECONDS_PER_ELEMENT_INSIDE = 5.6e-12
# DESIGN.md §2: pinned copies 55 GB/s in one direction, 49.5 GB/s each with both directions at once.
BIDIRECTIONAL_FACTOR = 49.5 / 55
# DESIGN.md §2: pageable copies 6.7 GB/s against 55 pinned (used when the pinned buffers exceed the budget).
PAGEABLE_SLOWDOWN = 55 / 6.7
# host_state="compact": its AdamW against torch's fused fp32 AdamW on the same host, measured with
# recipes/benchmark_host_adam.py --params 256e6 on the 16-core H200 host (2026-11-30): the one-pass kernel
# (optim/native_adam.c, 16-18 host bytes/param against fp32's 28) 5.445 against 4.340 G params/s, 1.25x;
# the chunked torch ops (its fallback without a C compiler; 4 M-element chunks, what 16 threads get)
# 1.292-1.40 against 4.34-4.41, 0.32x.
COMPACT_ADAM_SPEED = 1.25
COMPACT_ADAM_SPEED_CHUNKED = 0.32
# The host AdamW inside a step against the profile's standalone rate (less the bandwidth the copies take, below):
# on the 3B step of recipes/results/2026-11-30-h200-throughput.md the worker was busy 0.82-0.90 s per step where
# the standalone rate gives 0.661 s (the main thread, the pinned copies' staging and the page-cache traffic
# share the cores and the memory bandwidth with it). 0.661 / 0.86 = 0.77.
HOST_ADAM_IN_STEP = 0.77

_RESOURCES = {
    "device compute": "compute",
    "host->device copies": "host->device",
    "device->host copies": "device->host",
    "host optimizer": "host optimizer",
}


def step_times(shape: PlanShape, run: Run, hw: HardwareProfile, pinned_ok: bool = True,
               host_margin: float = 1.0) -> dict[str, float]:
    """Seconds per phase from the ceilings, and the step from the overlap condition.

    Device FLOPs per token: blocks 2N forward, 4N backward and 2N recompute for each block that is not
    kept, N the block parameters a token passes through (a mixture of experts: its active experts only,
    while the copies and the host AdamW below are on every parameter, plus its routing's work per routed row,
    ``ROUTED_SECONDS_PER_ELEMENT``), plus 2 x the MLP's parameters when it runs in chunks (each chunk's
    forward again in the backward); the head 2 forward + 4 backward (the chunked loss takes each chunk's
    gradients in its forward: ``models/head_loss.py``); causal attention 2·L·H·Q·T per pass (forward,
    recompute, twice in the backward) at its own rate, ``ATTENTION_EFFICIENCY`` of the peak (until 2026-12-03 it
    was charged whole at the matmuls' rate, 0.3 of the peak in effect: 64% too slow at 128 K tokens). Copies: a
    cached block's weights once per step, every other block's twice per micro-batch (forward and recompute), the resident fp32
    masters once per step; every gradient once per micro-batch back; each offloaded saved input to the host
    in the forward and back in the backward. Host work beside the backward: from the second micro-batch
    on, the worker adds each block's staged gradient into its fp32 accumulator (12 host bytes/param
    against AdamW's 28, so at 12/28 of the AdamW rate); in the last one it also runs AdamW per block as
    its gradient lands, slowed by the copies that share host memory bandwidth with it; the resident
    part's update follows the backward. Running on (``overlap_next_forward``), the block updates the
    backward leaves undone run during the next forward instead of before it; pooled gradient buffers
    bound how many are left (the backward waits for a free buffer), so the forward can hide at most
    ``grad_buffers`` blocks' updates; but each of its blocks waits for its own update, which for the first ones
    starts only near the end of the backward (:func:`host_chain_wait`; none for the blocks updated on the device,
    ``update_on_device``: what the device updates adds its update to the backward's device time, at the profile's
    ``device_update_gparams_per_s``). ``host_margin`` > 1 slows the host
    AdamW by that factor (what a placement is chosen with: ``placement.HOST_MARGIN``).
    """
    w, e = run.work, run.engine
    tokens = w.tokens
    rate = matmul_efficiency(shape.hidden, run.compiled()) * hw.peak_bf16_tflops * 1e12
    attn_rate = ATTENTION_EFFICIENCY * hw.peak_bf16_tflops * 1e12
    link = hw.link_gb_per_s * GB / (1 if pinned_ok else PAGEABLE_SLOWDOWN)
    layers = max(shape.layers, 1)
    keep = min(e.keep_activations, layers)
    cached = max(keep, min(e.cache_weights, layers))
    recompute = (layers - keep) / layers  # fraction of the blocks recomputed in the backward
    streamed = (layers - cached) / layers  # fraction of the block weights copied per micro-batch
    attn = 2 * shape.layers * shape.heads * shape.head_dim * w.seq_len  # per token, one causal pass
    active = shape.active_blocks  # a mixture of experts computes on its active experts only
    fwd_flops = tokens * (2 * active + 2 * shape.head_params)
    bwd_flops = tokens * ((4 + 2 * recompute) * active + 4 * shape.head_params
                          + (2 * shape.mlp if w.mlp_chunked else 0))
    per_row = ROUTED_SECONDS_PER_ELEMENT_INSIDE if shape.routing_inside and run.compiled() else ROUTED_SECONDS_PER_ELEMENT
    routed = tokens * shape.routed_rows * shape.hidden * per_row  # one pass (0: dense)
    dev_fwd = fwd_flops / rate + tokens * attn / attn_rate + routed
    dev_bwd = bwd_flops / rate + tokens * (2 + recompute) * attn / attn_rate + (2 + recompute) * routed
    weight_b = 2 if run.compact else 4  # compact: the bf16 half of the masters travels as it is
    inputs_b = e.offloaded_blocks(shape.layers) * saved_input_bytes(shape, run)  # offloaded saved inputs
    # The part before the blocks and the first block (and, asked for, cached ones) updated on the device
    # (engine/device_update.py): the former's weights stay there, the blocks' new ones are cast into their
    # slots, none of their gradients leave; their masters and moments (12 B/param) go home.
    on_device = shape.resident_params - shape.untied_head() if run.update_on_device else 0
    first = shape.block_params / layers  # the next forward's first block (and the size of any other)
    blocks_on_device = run.device_blocks(layers)  # the first and, beyond it, cached ones
    first_on_device = first * blocks_on_device
    # Their update runs on the compute stream as their gradients land (the blocks') or after the backward (the part
    # before the blocks): widen the bf16 gradients, the fused AdamW, cast the new weights into the slots.
    dev_bwd += (on_device + first_on_device) / (hw.device_update_gparams_per_s * 1e9)
    h2d_fwd_first = (weight_b * (shape.block_params - first_on_device) + 4 * (shape.resident_params - on_device)) / link
    h2d_fwd = weight_b * shape.block_params * streamed / link
    # a streamed first block updated on the device: its recompute's weights come from its device masters
    first_reload = first if blocks_on_device and cached < layers else 0
    h2d_bwd = (weight_b * (shape.block_params * streamed - first_reload) + inputs_b) / (link * BIDIRECTIONAL_FACTOR)
    grad_b = 2 if run.half_grads else 4  # a block's gradients on the link and into host memory
    # What the device updates stays there until the host state is read (engine/device_update.py, "home on
    # demand"); a streamed first block's slot is refilled from its device masters. Updated blocks send no
    # gradient either.
    d2h_fwd = inputs_b / (link * BIDIRECTIONAL_FACTOR)
    d2h_bwd = (grad_b * (shape.block_params - first_on_device)
               + 4 * (shape.resident_params - on_device)) / (link * BIDIRECTIONAL_FACTOR)
    compact_speed = COMPACT_ADAM_SPEED if run.compact_native else COMPACT_ADAM_SPEED_CHUNKED
    adam_rate = hw.host_adam_gparams_per_s * 1e9 * HOST_ADAM_IN_STEP * (compact_speed if run.compact else 1.0) / host_margin
    adam_blocks = (shape.block_params - first_on_device) / adam_rate
    adam_resident = (shape.resident_params - on_device) / adam_rate
    # An untied LM head (and the final norm) is updated during the backward (engine/resident.py): only
    # the part before the blocks (the embedding, a tied head with it) waits between backward and forward.
    adam_after = shape.untied_head() / adam_rate if run.head_in_backward and not w.clip else 0.0
    adam_before = adam_resident - adam_after
    add = 12 / 28 * shape.total_params / adam_rate  # one host accumulation of every gradient
    # The AdamW rate is host memory bandwidth (28 B/param). Beside it in the last backward, the gradient
    # copies write 4 (bf16: 2) B/param into host memory and the re-streamed blocks' masters are read
    # again: the update gets that much less of the same bandwidth. With bf16 gradients the one-pass kernel
    # reads 2 B/param of gradient instead of 4: 26 bytes.
    adam_b = 26 if run.half_grads else 28
    shared = (adam_b + grad_b + weight_b * streamed) / 28
    adam_blocks *= shared
    bwd = max(dev_bwd, h2d_bwd, d2h_bwd)
    fwd_first, fwd = max(dev_fwd, h2d_fwd_first, d2h_fwd), max(dev_fwd, h2d_fwd, d2h_fwd)
    # Updated on the host, a block's update waits for its gradients and the next forward for its update and
    # its weights' copy back: the blocks the backward finishes last (the forward's first) wait the longest.
    boundary = host_chain_wait(layers, run.host_blocks(layers), bwd, fwd_first,
                               shared * first / adam_rate, grad_b * first / (link * BIDIRECTIONAL_FACTOR),
                               weight_b * first / link)
    if w.accumulate == 1:
        last_host = adam_blocks + adam_after  # host work in the last backward
        before_last = fwd_first
    else:
        last_host = add + adam_blocks + adam_after
        before_last = (fwd_first + bwd) + (w.accumulate - 2) * (fwd + max(bwd, add)) + fwd
    if run.run_on:
        # The next step's first forward (fwd_first, as in the steady state) hides what is left over.
        pool = min(1.0, run.grad_buffers / layers) if run.pooled_grads else 1.0
        step = adam_before + max(before_last + bwd + boundary, before_last + last_host - pool * adam_blocks,
                                 before_last - fwd_first + last_host)
    else:
        step = before_last + max(bwd, last_host) + adam_before
    return {
        "device compute": w.accumulate * (dev_fwd + dev_bwd),
        "host->device copies": h2d_fwd_first + (w.accumulate - 1) * h2d_fwd + w.accumulate * h2d_bwd,
        "device->host copies": w.accumulate * (d2h_fwd + d2h_bwd),
        "host optimizer": adam_blocks + adam_resident + (w.accumulate - 1) * add,
        "forward (one micro-batch)": fwd,
        "backward (one micro-batch)": bwd,
        "step": step,
    }


def host_chain_wait(layers: int, host: list[int], bwd: float, fwd: float, adam: float, grad_copy: float,
                    weight_copy: float) -> float:
    """Seconds the next forward waits for the host's block updates, the blocks of equal size and time. The
    backward runs the blocks last to first (``bwd`` in all); a block's gradients are home ``grad_copy`` after
    its backward; the host runs one update at a time (``adam`` each), the landed one the next forward needs
    first (``engine/updates.py``: earliest deadline first); a block of the next forward (``fwd`` in all)
    starts once its update has run and its weights crossed (``weight_copy``). Block 0 alone on the host: its
    gradient copy, update and weight copy, in turn."""
    if not host or layers < 1:
        return 0.0
    landed = {b: (layers - b) * bwd / layers + grad_copy for b in host}
    done: dict[int, float] = {}
    clock = 0.0
    while landed:
        ready = [b for b, t in landed.items() if t <= clock]
        if not ready:
            clock = min(landed.values())
            continue
        b = min(ready)
        clock += adam
        done[b] = clock
        del landed[b]
    clock, wait = bwd, 0.0
    for b in range(layers):
        start = max(clock, done[b] + weight_copy) if b in done else clock
        wait += start - clock
        clock = start + fwd / layers
    return wait


def bottleneck(times: dict[str, float]) -> str:
    """The resource busy for the largest part of the step."""
    return _RESOURCES[max(_RESOURCES, key=lambda k: times[k])]
