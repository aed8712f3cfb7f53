"""Host and device bytes of one MegaTrainStrategy run, item by item, as the engine allocates them.

* host (``engine/store.py``): fp32 master 4 B, fp32 gradient accumulator 4 B, AdamW moments 8 B per
  parameter (``host_state="compact"``: the master as bf16 + int16 halves 4 B, bf16 moments 4 B, the
  gradient 4 B); masters and gradients pinned (compact: the bf16 half, which is what is copied); two
  pinned staging buffers of the gradient path's size when gradients accumulate (``engine/grads.py``);
  the offloaded block inputs (``offload_inputs``: the first N recomputed blocks); plus the process itself.
* device: the rotating slots plus one fixed slot per cached block, one fp32 staging buffer when fp32
  masters are cast on the device (``engine/slots.py``), two fp32 gradient slabs, the resident parameters
  as fp32 copies with fp32 gradients, the kept blocks' activations, the saved input of every other block
  (fp32: the residual stream stays fp32 under bf16 autocast; bf16 with ``saved_inputs_dtype="compute"``;
  an offloaded block's only while it is in flight, two at a time), and the larger of two transients that
  never coexist: the loss at the end of the forward (logits; with the chunked loss one chunk's logits plus
  the fp32 hidden states it keeps), and one block's recompute + backward working set during the backward
  (with ``mlp_chunk_tokens``, its MLP intermediates for one chunk of tokens: ``models/chunked_mlp.py``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..hardware import CUDA_CONTEXT_GB
from .run import Run
from .shape import PlanShape

if TYPE_CHECKING:
    from ..hardware import HardwareProfile

GB = 1e9  # decimal gigabytes, as memory is sold and as hardware profiles state it
GIB = 2**30

MASTER_B, GRAD_B, MOMENTS_B = 4, 4, 8  # host fp32 bytes per parameter, as engine/store.py allocates them
# Host memory of the process beside the training state: Python, torch, the CUDA runtime, cuBLAS/cuDNN and
# NCCL libraries mapped in, the data loader. An estimate (a CUDA torch process idles at 2-4 GB RSS).
PROCESS_OVERHEAD_GB = 3.0
# Device memory outside torch's allocator (CUDA context, cuBLAS workspaces): unavailable to tensors.
# CUDA_CONTEXT_GB, imported above from hardware.py (which reads free device memory with it).
# Loss bytes per logit element with Hugging Face's loss (bf16 logits, `.float()`, cross_entropy =
# log_softmax + nll): forward peak 2 (bf16) + 4 (fp32 upcast) + 4 (log_softmax output) = 10; backward
# peak 4 (saved log_softmax output) + 4 (nll's dense grad) + 4 (log_softmax's input grad) = 12.
LOGIT_BYTES_FORWARD = 2 + 4 + 4
LOGIT_BYTES_BACKWARD = 4 + 4 + 4
STAGING = "grad staging (2 x grad path x 4 B)"
OFFLOADED = "offloaded block inputs (pinned)"
PROCESS = "process overhead (estimate)"


def resident_part_params(shape: PlanShape, run: Run) -> int:
    """The larger resident part (``engine/resident.py``): before the blocks (embeddings, a tied head) or
    after them (an untied head); one part in engines before the split (``head_in_backward`` False)."""
    after = shape.untied_head() if run.head_in_backward else 0
    return max(shape.resident_params - after, after)


def grad_host_bytes(shape: PlanShape, run: Run) -> float:
    """Gradients on the host: full-size accumulators (bf16 for blocks with ``half_grads``), or the pool
    plus the stores larger than a block. A ``tried`` run's first steps lend nothing and send no bf16: every
    store gathers into an fp32 accumulator of its own (4 B/param), a pool coming on top once the overlapped
    steps start (the peak counted here; seen at 7B: 125.6 GB of host RSS, and gpt-oss-20b at 8 layers, whose
    14.7 B/param planned without them came to 16.4 and more, killed by the 126 GiB host)."""
    f = shape.trained_fraction  # frozen weights have no gradient (an even spread across stores assumed)
    if run.pooled_grads:
        own = shape.resident_params if shape.resident_params > shape.largest_block else 0
        pool = f * GRAD_B * (run.grad_buffers * shape.largest_block + own)
        return pool + (f * GRAD_B * (shape.block_params + shape.resident_params - own) if run.tried else 0)
    block_b = 2 if run.half_grads and not run.tried else GRAD_B
    return f * (block_b * shape.block_params + GRAD_B * shape.resident_params)


def host_bytes(shape: PlanShape, run: Run) -> dict[str, float]:
    """Host memory by item: 16 B/param of state (compact: 12; less with pooled gradients), pinned
    gradient staging, offloaded inputs, the process."""
    grad_path = max(shape.largest_block, resident_part_params(shape, run))  # slabs and staging
    grad_item = (f"fp32 grads (4 B/param: first steps; + pool of {run.grad_buffers})" if run.pooled_grads and run.tried
                 else f"fp32 grads (pool of {run.grad_buffers} blocks)" if run.pooled_grads
                 else "fp32 grads (4 B/param: first steps; then blocks bf16)" if run.half_grads and run.tried
                 else "grad buffers (blocks 2 B/param bf16, resident 4)" if run.half_grads
                 else "fp32 grad accumulator (4 B/param)")
    t = shape.trained
    if run.compact:
        state = {
            "master, bf16 + int16 halves (4 B/param)": MASTER_B * t,
            grad_item: grad_host_bytes(shape, run),
            "AdamW moments, bf16 (4 B/param)": MOMENTS_B // 2 * t,
        }
    else:
        state = {
            "fp32 master (4 B/param)": MASTER_B * t,
            grad_item: grad_host_bytes(shape, run),
            "AdamW moments (8 B/param)": MOMENTS_B * t,
        }
    if shape.trainable_params is not None:
        state["frozen weights (their own dtype)"] = shape.frozen_bytes
    saved_input = saved_input_bytes(shape, run)
    offloaded = run.engine.offloaded_blocks(shape.layers)
    return {
        **state,
        STAGING: 2 * grad_path * 4 if run.work.accumulate > 1 else 0,
        # torch's caching pinned allocator rounds each saved input up to a power of two
        OFFLOADED: offloaded * 2 ** math.ceil(math.log2(saved_input)),
        PROCESS: PROCESS_OVERHEAD_GB * GB,
    }


def saved_input_bytes(shape: PlanShape, run: Run) -> int:
    """One recomputed block's saved input, the residual stream of the micro-batch: tokens x hidden x 4 B
    (2 B with ``saved_inputs_dtype="compute"`` under bf16)."""
    narrow = run.engine.saved_inputs_dtype == "compute" and run.work.bf16
    return run.work.tokens * shape.hidden * (2 if narrow else 4)


def pinned_bytes(shape: PlanShape, run: Run) -> float:
    """Page-locked: masters and gradient accumulators (8 B/param; compact: 2 + 4) and the staging buffers."""
    master_b = 2 if run.compact else MASTER_B  # compact: only the bf16 half is copied, and pinned
    host = host_bytes(shape, run)
    return master_b * shape.total_params + grad_host_bytes(shape, run) + host[STAGING] + host[OFFLOADED]


# A block with routed experts, per (token, expert) row it routes, in bytes per expert MLP width I and per hidden
# width h (bf16 autocast, blocks compiled): what its recompute keeps, all of it and (kept_saves="matmuls") the
# matmul outputs, and its backward's transient gradients. Fitted to the kept graphs the strategy measured on the
# GPU (recipes/results/2026-12-06-session27.md): GPT-OSS-20B, experts eager between two graphs (a clamped GLU:
# gate_up's output, clamps, sigmoid, products, their masks), 307 KB per token at 20,480 and 36,864 tokens;
# Qwen3-30B-A3B, experts inside the block's graph (engine/compiled.inside_graphs: fused), 151 KB at 26,624 and
# 28,672. Each row also carries its gathered input and its weighted output (h terms).
ROUTED_ROW_ALL = {False: (16, 3), True: (6, 3)}  # routing_inside -> (x I, x h)
ROUTED_ROW_MATMULS = {False: (4, 4), True: (4, 3)}  # gate_up's output (4I), the gathered input and down's output


def routed_row_bytes(shape: PlanShape, per: dict[bool, tuple[int, int]]) -> float:
    """Bytes per token of a block's routed experts: its rows (``experts_per_token``) times ``per``'s bytes of a row
    for the way its experts run (0 for a dense model)."""
    i_mult, h_mult = per[shape.routing_inside]
    return shape.experts_per_token * (i_mult * shape.expert_intermediate + h_mult * shape.hidden)


def block_activations_per_token(shape: PlanShape, mlp_chunked: bool = False) -> float:
    """Bytes per token of one block's activations under bf16 autocast (see `block_working_set`). A chunked
    MLP keeps its fp32 input (4h, instead of the two bf16 copies gate and up keep) and none of its 8I; with
    the norm before it in the chunks (``shape.mlp_folds_norm``) not that norm's fp32 normalisation and
    output either (8h: the chunks keep the residual stream, which is kept anyway). A mixture of experts: the
    larger of a dense MLP of ``intermediate`` and its routed rows (:data:`ROUTED_ROW_ALL`)."""
    h, kv, inter = shape.hidden, shape.kv_dim, shape.intermediate
    if not mlp_chunked:
        return 30 * h + 6 * kv + max(8 * inter, routed_row_bytes(shape, ROUTED_ROW_ALL))
    return (22 if shape.mlp_folds_norm else 30) * h + 6 * kv


def kept_matmul_outputs_per_token(shape: PlanShape) -> float:
    """Bytes per token a kept block holds with ``kept_saves="matmuls"``: its fp32 input (4h) and the bf16
    outputs of q/k/v (2h + 4kv), attention (2h), o_proj (2h), gate and up (4I) and down (2h); a mixture of
    experts the larger of those MLP outputs and its routed rows' (:data:`ROUTED_ROW_MATMULS`)."""
    h, kv, inter = shape.hidden, shape.kv_dim, shape.intermediate
    return 12 * h + 4 * kv + max(4 * inter, routed_row_bytes(shape, ROUTED_ROW_MATMULS) - 2 * h)


def block_working_set(shape: PlanShape, tokens: int, bf16: bool = True, mlp_chunk_tokens: int | None = None) -> float:
    """Device bytes of one block's recompute and backward (a dense decoder layer, memory-efficient SDPA).

    Per token, under bf16 autocast with an fp32 residual: two RMSNorms (fp32 input 4h + output 2h each:
    12h), q/k/v (2h + 4kv) and rotated q/k (2h + 2kv), attention output 2h, o_proj output 2h and residual
    add 4h, MLP gate/up/act/product (8I), down output 2h and residual 4h: 30h + 6kv + 8I; plus backward
    transients (the fp32 residual gradient 4h, two bf16 MLP gradients 4I), and the block's bf16 parameter
    gradients before they are packed into the fp32 slab (2 B/param). A mixture of experts: its routed rows'
    activations (`block_activations_per_token`) and two bf16 gradients of each row's MLP (4 x expert width).

    With the MLP in chunks of ``mlp_chunk_tokens`` (fewer tokens than the micro-batch): 30h + 6kv per token
    kept, 22h + 6kv with the norm in the chunks (measured on the CPU for a Qwen2 layer under bf16 autocast,
    tests/test_plan_long_context.py), backward transients 10h per token (the fp32 residual gradient 4h, the MLP input's fp32 gradient
    4h, its output's bf16 gradient 2h), and for one chunk at a time its recompute and gradients (8I + 4I)
    with its bf16 input copies (4h) and, folded, the norm's normalisation and output (8h); plus the fp32 sums of the MLP's weight gradients (4 B per MLP
    parameter) and one chunk's bf16 weight gradients (2 B).
    """
    h, inter = shape.hidden, shape.intermediate
    scale = 1 if bf16 else 2  # fp32 activations are twice as wide
    if mlp_chunk_tokens is None or tokens <= mlp_chunk_tokens:
        per_token = block_activations_per_token(shape) + 4 * h + max(4 * inter, 4 * shape.experts_per_token
                                                                     * shape.expert_intermediate)
        return scale * (tokens * per_token + 2 * shape.largest_block)
    per_token = block_activations_per_token(shape, mlp_chunked=True) + 10 * h
    per_chunk_token = 12 * inter + (12 if shape.mlp_folds_norm else 4) * h
    mlp_block = shape.mlp / max(shape.layers, 1)
    return (scale * (tokens * per_token + mlp_chunk_tokens * per_chunk_token + 2 * shape.largest_block)
            + (4 + 2 * scale) * mlp_block)


def loss_bytes(shape: PlanShape, tokens: int, loss_chunk_tokens: int | None) -> float:
    """Device bytes of the loss: the logits of all tokens (Hugging Face's loss), or with the chunked loss
    one chunk's logits plus what it keeps over the whole sequence, 16 B x hidden per token in fp32: the last
    block's output and the final norm's saved normalisation, its output (the chunks' input) and the
    gradient chunks gathered for it."""
    if loss_chunk_tokens is None or tokens <= loss_chunk_tokens:
        return tokens * shape.vocab * max(LOGIT_BYTES_FORWARD, LOGIT_BYTES_BACKWARD)
    return (loss_chunk_tokens * shape.vocab * max(LOGIT_BYTES_FORWARD, LOGIT_BYTES_BACKWARD)
            + 16 * shape.hidden * tokens)


def gpu_bytes(shape: PlanShape, run: Run) -> dict[str, float]:
    """Device memory by item at this micro-batch shape (see `gpu_peak` for how they combine)."""
    w, e = run.work, run.engine
    compute_b = 2 if w.bf16 else 4
    # one fp32 staging buffer when fp32 masters are cast on the device (compact bf16 masters need none)
    staging = 4 * shape.largest_block if w.bf16 and not run.compact else 0
    tokens = w.tokens
    chunked = w.loss_chunk_tokens is not None and tokens > w.loss_chunk_tokens
    keep = min(e.keep_activations, shape.layers)
    cached = max(keep, min(e.cache_weights, shape.layers))
    offloaded = e.offloaded_blocks(shape.layers)
    on_device = shape.layers - keep - offloaded + min(offloaded, 2)  # two offloaded ones in flight
    narrow = e.saved_inputs_dtype == "compute" and w.bf16
    scale = 1 if w.bf16 else 2
    return {
        f"weight slots ({e.slots} + {cached} cached, x block x {compute_b} B) + staging": (e.slots + cached)
        * shape.largest_block * compute_b + staging,
        "grad slabs (2 x grad path x 4 B)": 2 * max(shape.largest_block, resident_part_params(shape, run)) * 4,
        # fp32 copies of all; gradients of the part before the blocks (the after part's went home at the
        # first block's backward, before the peak)
        "resident params + grads": 4 * shape.resident_params
        + 4 * (shape.resident_params - (shape.untied_head() if run.head_in_backward else 0)),
        # update_on_device: the embedding's moments; each block's fp32 masters and moments, one's gradients
        "embedding and block Adam state (updated on device)":
            8 * (shape.resident_params - shape.untied_head())
            + (12 * run.device_blocks(shape.layers) + 4) * shape.block_params / shape.layers
            if run.update_on_device else 0,
        "LM head autocast copy (2 B/param)": 2 * shape.head_params if w.bf16 else 0,
        f"saved block inputs ({'bf16' if narrow else 'fp32'})": on_device * saved_input_bytes(shape, run),
        f"saved: kept activations ({keep} blocks)": keep * tokens * scale * (
            kept_matmul_outputs_per_token(shape) if e.kept_saves == "matmuls"
            else block_activations_per_token(shape, w.mlp_chunked)),
        ("transient: loss (logit chunk, hidden states)" if chunked else "transient: loss (logits)"):
            loss_bytes(shape, tokens, w.loss_chunk_tokens),
        "transient: one block's recompute": block_working_set(shape, tokens, w.bf16, w.mlp_chunk_tokens),
    }


def lasting_weights(items: dict[str, float]) -> float:
    """Device bytes that do not depend on the micro-batch shape."""
    return sum(v for k, v in items.items() if not k.startswith(("transient", "saved")))


def gpu_peak(items: dict[str, float]) -> float:
    """Lasting items plus the larger transient: the loss is freed before the first block's backward."""
    lasting = sum(v for k, v in items.items() if not k.startswith("transient"))
    return lasting + max(v for k, v in items.items() if k.startswith("transient"))


def fits_memory(shape: PlanShape, run: Run, available: float, host_available: float | None = None) -> bool:
    """Whether the device peak fits ``available`` bytes (and the host footprint ``host_available``, when
    given: offloaded inputs grow with the sequence)."""
    if gpu_peak(gpu_bytes(shape, run)) > available:
        return False
    return host_available is None or sum(host_bytes(shape, run).values()) <= host_available


def device_available(hw: HardwareProfile) -> float:
    """Device bytes for tensors: the device's memory less the CUDA context."""
    return (hw.device_memory_gb - (CUDA_CONTEXT_GB if hw.accelerator == "cuda" else 0)) * GB
