"""The planner: host bytes, GPU bytes and step time of one MegaTrainStrategy run, before allocating.

    python -m megatrain_lightning.plan model=qwen2_5_7b hardware=h200 [data.seq_len=4096 ...]

Everything here is arithmetic on a `PlanShape` (parameter counts and widths read off a meta-device
model) and a `HardwareProfile`'s ceilings: link bandwidth, bf16 matmul rate, host AdamW rate, host
and device memory. Nothing is fitted to measured runs (recipes/results/2026-11-30-planner-vs-measured.md
compares). The byte counts follow what the engine allocates:

* host (engine/host_store.py): fp32 master 4 B, fp32 gradient accumulator 4 B, AdamW moments 8 B per
  parameter (with `host_state="compact"`: the master as bf16 + int16 halves 4 B, bf16 moments 4 B, the
  gradient 4 B); masters and gradients pinned (compact: the bf16 half, which is what is copied); two
  pinned staging buffers of the gradient path's size when gradients accumulate (engine/pipeline.py
  `_GradPath`); plus the process itself.
* device: `slots` rotating weight slots plus one fixed slot per cached block (`cache_weights`), one fp32
  staging buffer when fp32 masters are cast on the device (engine/device_slots.py), two fp32 gradient
  slabs, the resident parameters (embeddings, final norm, head) as fp32 copies with fp32 gradients, the
  activations of the kept blocks (`keep_activations`), the saved input of every other block (fp32: the
  residual stream stays fp32 under bf16 autocast; two in flight with `offload_inputs`), and the larger
  of two transients that never coexist: the loss (logits) at the end of the forward, and one block's
  recompute + backward working set during the backward.

Step time is the overlap condition: each phase takes as long as its slowest resource (device compute,
host→device copies, device→host copies), and the host AdamW runs beside the last backward.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatrain_lightning.errors import ConfigError
from megatrain_lightning.hardware import HardwareProfile

GB = 1e9
GIB = 2**30

# --- constants, each with where it comes from ---------------------------------------------------------
# Fraction of the profile's bf16 matmul peak that a transformer block's forward + backward reaches.
# DESIGN.md §2: one Llama-7B-shaped layer, bf16 fwd+bwd, ran at ~460 / ~510 / ~505 TFLOPS of real work at
# 2 K / 8 K / 16 K tokens against the 803 TFLOPS matmul ceiling: 0.57-0.64.
MATMUL_EFFICIENCY = 0.6
# DESIGN.md §2: pinned copies 55 GB/s in one direction, 49.5 GB/s each with both directions at once.
BIDIRECTIONAL_FACTOR = 49.5 / 55
# DESIGN.md §2: pageable copies 6.7 GB/s against 55 pinned (used when the pinned buffers exceed the budget).
PAGEABLE_SLOWDOWN = 55 / 6.7
# Host memory of the process beside the training state: Python, torch, the CUDA runtime, cuBLAS/cuDNN and
# NCCL libraries mapped in, the data loader. An estimate (a CUDA torch process idles at 2-4 GB RSS).
PROCESS_OVERHEAD_GB = 3.0
# Device memory outside torch's allocator (CUDA context, cuBLAS workspaces): unavailable to tensors.
CUDA_CONTEXT_GB = 1.0
# Loss bytes per logit element with Hugging Face's loss (bf16 logits, `.float()`, cross_entropy =
# log_softmax + nll): forward peak 2 (bf16) + 4 (fp32 upcast) + 4 (log_softmax output) = 10; backward
# peak 4 (saved log_softmax output) + 4 (nll's dense grad) + 4 (log_softmax's input grad) = 12.
LOGIT_BYTES_FORWARD = 2 + 4 + 4
LOGIT_BYTES_BACKWARD = 4 + 4 + 4
# host_state="compact": its AdamW (rebuild the fp32 master from two halves, fused AdamW, split, round the
# bf16 moments stochastically) against torch's fused fp32 AdamW on the same host, measured with
# recipes/benchmark_host_adam.py --params 256e6 on the 16-core H200 host (2026-11-30): the one-pass kernel
# (engine/native_adam.c, 16-18 host bytes/param against fp32's 28) 5.445 against 4.340 G params/s, 1.25x;
# the chunked torch ops (its fallback without a C compiler; 4 M-element chunks, what 16 threads get)
# 1.292-1.40 against 4.34-4.41, 0.32x.
COMPACT_ADAM_SPEED = 1.25
COMPACT_ADAM_SPEED_CHUNKED = 0.32
# Host-side fp32 bytes per parameter, as engine/host_store.py allocates them.
MASTER_B, GRAD_B, MOMENTS_B = 4, 4, 8


@dataclass(frozen=True)
class PlanShape:
    """What the planner needs of a model: counts (parameters) and widths (elements)."""

    total_params: int  # every parameter once (tied weights once)
    block_params: int  # sum over the streamed blocks
    largest_block: int  # parameters of the largest block: the size of a slot
    resident_params: int  # everything outside the blocks: embeddings, final norm, head
    head_params: int  # the LM head's matmul weight (the embedding when tied)
    layers: int
    heads: int
    head_dim: int
    kv_dim: int  # key/value heads x head dim
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, model) -> PlanShape:  # noqa: ANN001 (a transformers PreTrainedModel, meta device is fine)
        """Counts from a Hugging Face causal LM; the blocks are the ones MegaTrainStrategy would stream."""
        from megatrain_lightning.blocks import find_blocks

        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        blocks = [m for _, m in find_blocks(model)]
        sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
        total = sum(p.numel() for p in model.parameters())  # parameters() deduplicates tied weights
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        out = model.get_output_embeddings()
        return cls(
            total_params=total,
            block_params=sum(sizes),
            largest_block=max(sizes),
            resident_params=total - sum(sizes),
            head_params=out.weight.numel() if out is not None else 0,
            layers=len(blocks),
            heads=heads,
            head_dim=head_dim,
            kv_dim=kv_heads * head_dim,
            hidden=config.hidden_size,
            intermediate=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
            vocab=config.vocab_size,
        )


@dataclass(frozen=True)
class RunSettings:
    """What a run chooses: micro-batch shape, accumulation, slots, loss chunking, precision."""

    micro_batch: int
    seq_len: int
    accumulate: int = 1
    slots: int = 2
    loss_chunk_tokens: int | None = None  # None: Hugging Face's loss over all logits at once
    bf16: bool = True  # compute dtype bf16 (slots stage fp32 then cast); False: fp32 everywhere
    compact_state: bool = False  # host_state="compact": 8 B/param lasting state, bf16 weight copies
    compact_native: bool = True  # its one-pass kernel builds (False: the chunked torch ops, engines before 12283d1)
    keep_activations: int = 0  # last blocks not recomputed (their activations stay on the device)
    kept_saves_matmuls: bool = False  # kept_saves="matmuls": kept blocks hold matmul/attention outputs only
    cache_weights: int = 0  # last blocks whose weights stay on the device for the step
    offload_inputs: bool = False  # saved block inputs in pinned host memory
    grad_buffers: int = 4  # pooled gradient buffers (MegaTrainStrategy.grad_buffers)
    clip: bool = False  # gradient clipping: the host step follows the backward (no overlap, no pool)
    run_on: bool = True  # overlap_next_forward: updates the backward did not finish run on into the next forward
    head_in_backward: bool = True  # an untied head's update overlaps the backward (False: engines before commit 2f37add)
    # MegaTrainStrategy.bf16_grads: block gradients travel and wait as bf16 (plan.py: the strategy's default,
    # None, plans as True, assuming the one-pass kernel builds on the target)
    bf16_grads: bool = False
    split_embedding: bool = False  # MegaTrainStrategy.split_embedding_update (untied input embeddings)

    @property
    def pooled_grads(self) -> bool:
        """Whether block gradients live in the pool rather than in full-size accumulators."""
        return self.accumulate == 1 and self.grad_buffers > 0 and not self.clip

    @property
    def half_grads(self) -> bool:
        """Whether block gradients travel and wait on the host as bf16 (straight into the overlapped update)."""
        return self.bf16_grads and self.bf16 and self.accumulate == 1 and not self.clip

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


@dataclass(frozen=True)
class Plan:
    """The planner's answer: bytes by item, seconds by phase, the bottleneck, and the largest shapes."""

    model: str
    hardware: str
    shape: PlanShape
    run: RunSettings
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
    max_micro_batch: int  # at run.seq_len
    max_seq_len: int  # at run.micro_batch

    @property
    def tokens_per_s(self) -> float:
        return self.run.tokens * self.run.accumulate / self.step_s


# ------------------------------------------------------------------------------------------------ bytes
def grad_host_bytes(shape: PlanShape, run: RunSettings) -> float:
    """Gradients on the host: full-size accumulators (bf16 for blocks with ``half_grads``), or the pool
    plus the stores larger than a block."""
    if not run.pooled_grads:
        block_b = 2 if run.half_grads else GRAD_B
        return block_b * shape.block_params + GRAD_B * shape.resident_params
    own = shape.resident_params if shape.resident_params > shape.largest_block else 0
    return GRAD_B * (run.grad_buffers * shape.largest_block + own)


def host_bytes(shape: PlanShape, run: RunSettings) -> dict[str, float]:
    """Host memory by item: 16 B/param of state (compact: 12; less with pooled gradients), pinned
    gradient staging, the process."""
    grad_path = max(shape.largest_block, resident_part_params(shape, run))  # _GradPath's numel: slabs and staging
    grad_item = (f"fp32 grads (pool of {run.grad_buffers} blocks)" if run.pooled_grads
                 else "grad buffers (blocks 2 B/param bf16, resident 4)" if run.half_grads
                 else "fp32 grad accumulator (4 B/param)")
    if run.compact_state:
        state = {
            "master, bf16 + int16 halves (4 B/param)": MASTER_B * shape.total_params,
            grad_item: grad_host_bytes(shape, run),
            "AdamW moments, bf16 (4 B/param)": MOMENTS_B // 2 * shape.total_params,
        }
    else:
        state = {
            "fp32 master (4 B/param)": MASTER_B * shape.total_params,
            grad_item: grad_host_bytes(shape, run),
            "AdamW moments (8 B/param)": MOMENTS_B * shape.total_params,
        }
    saved_input = run.tokens * shape.hidden * 4
    offloaded = (shape.layers - min(run.keep_activations, shape.layers)) if run.offload_inputs else 0
    return {
        **state,
        "grad staging (2 x grad path x 4 B)": 2 * grad_path * 4 if run.accumulate > 1 else 0,
        # torch's caching pinned allocator rounds each saved input up to a power of two
        "offloaded block inputs (pinned)": offloaded * 2 ** math.ceil(math.log2(saved_input)),
        "process overhead (estimate)": PROCESS_OVERHEAD_GB * GB,
    }


def pinned_bytes(shape: PlanShape, run: RunSettings) -> float:
    """Page-locked: masters and gradient accumulators (8 B/param; compact: 2 + 4) and the staging buffers."""
    master_b = 2 if run.compact_state else MASTER_B  # compact: only the bf16 half is copied, and pinned
    host = host_bytes(shape, run)
    staged = host["grad staging (2 x grad path x 4 B)"] + host["offloaded block inputs (pinned)"]
    return master_b * shape.total_params + grad_host_bytes(shape, run) + staged


def block_activations_per_token(shape: PlanShape) -> float:
    """Bytes per token of one block's activations under bf16 autocast (see `block_working_set`)."""
    h, kv, inter = shape.hidden, shape.kv_dim, shape.intermediate
    return 30 * h + 6 * kv + 8 * inter


def kept_matmul_outputs_per_token(shape: PlanShape) -> float:
    """Bytes per token a kept block holds with ``kept_saves="matmuls"``: its fp32 input (4h) and the bf16
    outputs of q/k/v (2h + 4kv), attention (2h), o_proj (2h), gate and up (4I) and down (2h)."""
    h, kv, inter = shape.hidden, shape.kv_dim, shape.intermediate
    return 12 * h + 4 * kv + 4 * inter


def block_working_set(shape: PlanShape, tokens: int, bf16: bool = True) -> float:
    """Device bytes of one block's recompute and backward (a dense decoder layer, memory-efficient SDPA).

    Per token, under bf16 autocast with an fp32 residual: two RMSNorms (fp32 input 4h + output 2h each:
    12h), q/k/v (2h + 4kv) and rotated q/k (2h + 2kv), attention output 2h, o_proj output 2h and residual
    add 4h, MLP gate/up/act/product (8I), down output 2h and residual 4h: 30h + 6kv + 8I; plus backward
    transients (the fp32 residual gradient 4h, two bf16 MLP gradients 4I), and the block's bf16 parameter
    gradients before they are packed into the fp32 slab (2 B/param). A mixture of experts is not modelled.
    """
    h, inter = shape.hidden, shape.intermediate
    per_token = block_activations_per_token(shape) + 4 * h + 4 * inter
    scale = 1 if bf16 else 2  # fp32 activations are twice as wide
    return scale * (tokens * per_token + 2 * shape.largest_block)


def untied_head_params(shape: PlanShape) -> int:
    """Parameters of an untied LM head (0 when tied): with the final norm, the resident part after the blocks."""
    return shape.head_params if shape.resident_params >= 2 * shape.head_params > 0 else 0


def resident_part_params(shape: PlanShape, run: RunSettings) -> int:
    """The larger resident part (engine/resident.py): the part before the blocks (embeddings, a tied head)
    or after them (an untied head); one part in engines before the split (``head_in_backward`` False)."""
    after = untied_head_params(shape) if run.head_in_backward else 0
    return max(shape.resident_params - after, after)


def gpu_bytes(shape: PlanShape, run: RunSettings) -> dict[str, float]:
    """Device memory by item at this micro-batch shape (see `gpu_peak` for how they combine)."""
    compute_b = 2 if run.bf16 else 4
    # one fp32 staging buffer when fp32 masters are cast on the device (compact bf16 masters need none)
    staging = 4 * shape.largest_block if run.bf16 and not run.compact_state else 0
    tokens = run.tokens
    chunked = run.loss_chunk_tokens is not None and tokens > run.loss_chunk_tokens
    logit_tokens = run.loss_chunk_tokens if chunked else tokens
    keep = min(run.keep_activations, shape.layers)
    cached = max(keep, min(run.cache_weights, shape.layers))
    saved = shape.layers - keep
    scale = 1 if run.bf16 else 2
    return {
        f"weight slots ({run.slots} + {cached} cached, x block x {compute_b} B) + staging": (run.slots + cached)
        * shape.largest_block * compute_b + staging,
        "grad slabs (2 x grad path x 4 B)": 2 * max(shape.largest_block, resident_part_params(shape, run)) * 4,
        # fp32 copies of all; gradients of the part before the blocks (the after part's went home at the
        # first block's backward, before the peak)
        "resident params + grads": 4 * shape.resident_params
        + 4 * (shape.resident_params - (untied_head_params(shape) if run.head_in_backward else 0)),
        "LM head autocast copy (2 B/param)": 2 * shape.head_params if run.bf16 else 0,
        "saved block inputs (fp32)": (min(saved, 2) if run.offload_inputs else saved) * tokens * shape.hidden * 4,
        f"saved: kept activations ({keep} blocks)": keep * tokens * scale * (
            kept_matmul_outputs_per_token(shape) if run.kept_saves_matmuls else block_activations_per_token(shape)),
        "transient: loss (logits)": logit_tokens * shape.vocab * max(LOGIT_BYTES_FORWARD, LOGIT_BYTES_BACKWARD),
        "transient: one block's recompute": block_working_set(shape, tokens, run.bf16),
    }


def _lasting_weights(items: dict[str, float]) -> float:
    """Device bytes that do not depend on the micro-batch shape."""
    return sum(v for k, v in items.items() if not k.startswith(("transient", "saved")))


def gpu_peak(items: dict[str, float]) -> float:
    """Lasting items plus the larger transient: the loss is freed before the first block's backward."""
    lasting = sum(v for k, v in items.items() if not k.startswith("transient"))
    return lasting + max(v for k, v in items.items() if k.startswith("transient"))


# ------------------------------------------------------------------------------------------------- time
def step_times(shape: PlanShape, run: RunSettings, hw: HardwareProfile, pinned_ok: bool = True) -> dict[str, float]:
    """Seconds per phase from the ceilings, and the step from the overlap condition.

    Device FLOPs per token: blocks 2N forward, 4N backward and 2N recompute for each block that is not
    kept; the head 2 forward + 4 backward (+2 when the chunked loss recomputes it); attention 16·L·H·Q·T
    with recompute (DESIGN.md §6, hardware FLOPs). Copies: a cached block's weights once per step, every
    other block's twice per micro-batch (forward and recompute), the resident fp32 masters once per step;
    every gradient once per micro-batch back. Host work beside the backward: from the second micro-batch
    on, the worker adds each block's staged gradient into its fp32 accumulator (12 host bytes/param
    against AdamW's 28, so at 12/28 of the AdamW rate); in the last one it also runs AdamW per block as
    its gradient lands, slowed by the copies that share host memory bandwidth with it; the resident
    part's update follows the backward. With ``run_on`` the block updates the backward leaves undone run
    during the next forward instead of before it; pooled gradient buffers bound how many are left (the
    backward waits for a free buffer), so the forward can hide at most ``grad_buffers`` blocks' updates.
    """
    tokens = run.tokens
    rate = MATMUL_EFFICIENCY * hw.peak_bf16_tflops * 1e12
    link = hw.link_gb_per_s * GB / (1 if pinned_ok else PAGEABLE_SLOWDOWN)
    chunked = run.loss_chunk_tokens is not None and tokens > run.loss_chunk_tokens
    layers = max(shape.layers, 1)
    keep = min(run.keep_activations, layers)
    cached = max(keep, min(run.cache_weights, layers))
    recompute = (layers - keep) / layers  # fraction of the blocks recomputed in the backward
    streamed = (layers - cached) / layers  # fraction of the block weights copied per micro-batch
    attn = 4 * shape.layers * shape.heads * shape.head_dim * run.seq_len  # per token, one pass
    fwd_flops = tokens * (2 * shape.block_params + 2 * shape.head_params + attn)
    bwd_flops = tokens * ((4 + 2 * recompute) * shape.block_params + (6 if chunked else 4) * shape.head_params
                          + (2 + recompute) * attn)
    dev_fwd, dev_bwd = fwd_flops / rate, bwd_flops / rate
    weight_b = 2 if run.compact_state else 4  # compact: the bf16 half of the masters travels as it is
    h2d_fwd_first = (weight_b * shape.block_params + 4 * shape.resident_params) / link
    h2d_fwd = weight_b * shape.block_params * streamed / link
    h2d_bwd = weight_b * shape.block_params * streamed / (link * BIDIRECTIONAL_FACTOR)
    grad_b = 2 if run.half_grads else 4  # a block's gradients on the link and into host memory
    d2h_bwd = (grad_b * shape.block_params + 4 * shape.resident_params) / (link * BIDIRECTIONAL_FACTOR)
    compact_speed = COMPACT_ADAM_SPEED if run.compact_native else COMPACT_ADAM_SPEED_CHUNKED
    adam_rate = hw.host_adam_gparams_per_s * 1e9 * (compact_speed if run.compact_state else 1.0)
    adam_blocks, adam_resident = shape.block_params / adam_rate, shape.resident_params / adam_rate
    # An untied LM head (and the final norm) is updated during the backward (engine/resident.py): only
    # the part before the blocks (the embedding, a tied head with it) waits between backward and forward.
    untied_head = untied_head_params(shape)
    adam_after = untied_head / adam_rate if run.head_in_backward and not run.clip else 0.0
    adam_before = adam_resident - adam_after
    add = 12 / 28 * shape.total_params / adam_rate  # one host accumulation of every gradient
    # The AdamW rate is host memory bandwidth (28 B/param). Beside it in the last backward, the gradient
    # copies write 4 (bf16: 2) B/param into host memory and the re-streamed blocks' masters are read
    # again: the update gets that much less of the same bandwidth. With bf16 gradients the one-pass kernel
    # (engine/native_adam.c) reads 2 B/param of gradient instead of 4: 26 bytes.
    adam_b = 26 if run.half_grads else 28
    shared = (adam_b + grad_b + weight_b * streamed) / 28
    adam_blocks *= shared
    bwd = max(dev_bwd, h2d_bwd, d2h_bwd)
    fwd_first, fwd = max(dev_fwd, h2d_fwd_first), max(dev_fwd, h2d_fwd)
    split = 0.0  # host seconds of an untied embedding's first half, moved into the backward
    if run.split_embedding and untied_head and run.accumulate == 1 and not run.clip:
        # every row's zero-gradient update beside the backward; after it, the looked-up rows only (at most
        # one per token)
        split = adam_before
        adam_before *= min(1.0, run.tokens / max(shape.vocab, 1))
    if run.accumulate == 1:
        last_host = adam_blocks + adam_after + split  # host work in the last backward
        before_last = fwd_first
    else:
        last_host = add + adam_blocks + adam_after
        before_last = (fwd_first + bwd) + (run.accumulate - 2) * (fwd + max(bwd, add)) + fwd
    if run.run_on and not run.clip:
        # The next step's first forward (fwd_first, as in the steady state) hides what is left over.
        pool = min(1.0, run.grad_buffers / layers) if run.pooled_grads else 1.0
        step = adam_before + max(before_last + bwd, before_last + last_host - pool * adam_blocks,
                                 before_last - fwd_first + last_host)
    else:
        step = before_last + max(bwd, last_host) + adam_before
    return {
        "device compute": run.accumulate * (dev_fwd + dev_bwd),
        "host->device copies": h2d_fwd_first + (run.accumulate - 1) * h2d_fwd + run.accumulate * h2d_bwd,
        "device->host copies": run.accumulate * d2h_bwd,
        "host optimizer": adam_blocks + adam_resident + split * min(1.0, run.tokens / max(shape.vocab, 1))
        + (run.accumulate - 1) * add,
        "forward (one micro-batch)": fwd,
        "backward (one micro-batch)": bwd,
        "step": step,
    }


_RESOURCES = {
    "device compute": "compute",
    "host->device copies": "host->device",
    "device->host copies": "device->host",
    "host optimizer": "host optimizer",
}


def bottleneck(times: dict[str, float]) -> str:
    """The resource busy for the largest part of the step."""
    return _RESOURCES[max(_RESOURCES, key=lambda k: times[k])]


# ------------------------------------------------------------------------------------------------- plan
def _fits(shape: PlanShape, run: RunSettings, available: float) -> bool:
    return gpu_peak(gpu_bytes(shape, run)) <= available


def _largest(shape: PlanShape, run: RunSettings, available: float, field: str, limit: int) -> int:
    """Largest value of `field` (micro_batch or seq_len) whose device peak fits: memory grows with it, so bisect."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(shape, dataclasses.replace(run, **{field: mid}), available):
            lo = mid
        else:
            hi = mid - 1
    return lo


def largest_micro_batch(shape: PlanShape, run: RunSettings, available: float, limit: int = 1 << 14) -> int:
    """Largest micro-batch at `run.seq_len` whose device peak fits (0: not even one row)."""
    return _largest(shape, run, available, "micro_batch", limit)


def largest_seq_len(shape: PlanShape, run: RunSettings, available: float, limit: int = 1 << 22) -> int:
    """Largest sequence length at `run.micro_batch` that fits, rounded down to a multiple of 128."""
    lo = _largest(shape, run, available, "seq_len", limit)
    return lo // 128 * 128 if lo >= 128 else lo


def make_plan(shape: PlanShape, run: RunSettings, hw: HardwareProfile, model: str = "the model", refuse: bool = True) -> Plan:
    """The plan for `model` on `hw`; with `refuse`, a ConfigError when host or device memory is short."""
    host = host_bytes(shape, run)
    host_total = sum(host.values())
    host_available = hw.host_memory_gb * GB
    if refuse and host_total > host_available:
        state = host_total - host["grad staging (2 x grad path x 4 B)"] - host["offloaded block inputs (pinned)"] \
            - PROCESS_OVERHEAD_GB * GB
        per_param = state / shape.total_params
        raise ConfigError(
            f"model={model} ({shape.total_params / 1e9:.2f} B parameters) needs {host_total / GB:,.1f} GB of host "
            f"memory ({state / GB:,.1f} GB of master, gradient and AdamW state at {per_param:.1f} B/param, "
            f"{(host_total - state) / GB:.1f} GB staging and process), but hardware={hw.name} has "
            f"{hw.host_memory_gb:,.0f} GB: choose a smaller model or a profile with more host memory "
            f"(or set hardware.host_memory_gb if the profile is wrong for this machine)"
        )
    pinned = pinned_bytes(shape, run)
    pinned_ok = hw.accelerator == "cuda" and pinned <= hw.pinned_budget_gb * GB
    gpu = gpu_bytes(shape, run)
    gpu_total = gpu_peak(gpu)
    gpu_available = (hw.device_memory_gb - (CUDA_CONTEXT_GB if hw.accelerator == "cuda" else 0)) * GB
    max_mb = largest_micro_batch(shape, run, gpu_available)
    max_seq = largest_seq_len(shape, run, gpu_available)
    if refuse and gpu_total > gpu_available:
        raise ConfigError(
            f"model={model} at micro-batch {run.micro_batch} x {run.seq_len} tokens needs {gpu_total / GB:.1f} GB of "
            f"device memory but hardware={hw.name} has {gpu_available / GB:.1f} GB for tensors: "
            + (
                f"use at most data.batch_size={max_mb} at this seq_len, or data.seq_len={max_seq} at this micro-batch "
                f"(and trainer.accumulate_grad_batches for more tokens per step), or set model.loss_chunk_tokens"
                if max_mb or max_seq
                else f"even one row does not fit ({_lasting_weights(gpu) / GB:.1f} GB are weight slots, gradient slabs "
                f"and resident parameters): choose a device with more memory or fewer strategy.slots"
            )
        )
    times = step_times(shape, run, hw, pinned_ok or hw.accelerator != "cuda")
    return Plan(
        model=model, hardware=hw.name, shape=shape, run=run,
        host=host, host_total=host_total, host_available=host_available, pinned=pinned, pinned_ok=pinned_ok,
        gpu=gpu, gpu_total=gpu_total, gpu_available=gpu_available,
        times=times, step_s=times["step"], bottleneck=bottleneck(times),
        max_micro_batch=max_mb, max_seq_len=max_seq,
    )


def format_plan(plan: Plan) -> str:
    """The short table the planner prints."""
    s, r = plan.shape, plan.run
    n = s.total_params
    lines = [
        f"plan: model={plan.model} ({n / 1e9:.3f} B params: {s.layers} blocks of up to {s.largest_block / 1e6:.1f} M, "
        f"{s.resident_params / 1e6:.1f} M resident) on hardware={plan.hardware}",
        f"run: micro-batch {r.micro_batch} x seq {r.seq_len}, accumulate {r.accumulate}, slots {r.slots}, "
        f"loss {'chunks of ' + str(r.loss_chunk_tokens) + ' tokens' if r.loss_chunk_tokens else 'unchunked'}",
        "",
        f"{'host memory':<44}{'GB':>10}{'B/param':>10}",
    ]
    for k, v in plan.host.items():
        lines.append(f"  {k:<42}{v / GB:>10.2f}{v / n:>10.2f}")
    lines.append(f"  {'total':<42}{plan.host_total / GB:>10.2f}{plan.host_total / n:>10.2f}"
                 f"   of {plan.host_available / GB:,.0f} GB")
    lines.append(f"  {'pinned (masters, grads, staging)':<42}{plan.pinned / GB:>10.2f}{plan.pinned / n:>10.2f}"
                 f"   {'within' if plan.pinned_ok else 'OVER (pageable copies)'} budget")
    lines += ["", f"{'GPU memory':<44}{'GB':>10}"]
    for k, v in plan.gpu.items():
        lines.append(f"  {k:<42}{v / GB:>10.2f}")
    lines.append(f"  {'peak (lasting + larger transient)':<42}{plan.gpu_total / GB:>10.2f}"
                 f"   of {plan.gpu_available / GB:.1f} GB ({plan.gpu_total / GIB:.1f} GiB)")
    lines += ["", f"{'time per optimizer step':<44}{'s':>10}"]
    for k, v in plan.times.items():
        lines.append(f"  {k:<42}{v:>10.3f}")
    lines += [
        f"  bottleneck: {plan.bottleneck}; {plan.tokens_per_s:,.0f} tokens/s "
        f"(at {MATMUL_EFFICIENCY:.0%} of {plan.hardware}'s bf16 peak)",
        "",
        f"largest micro-batch at seq {r.seq_len}: {plan.max_micro_batch}; "
        f"largest seq len at micro-batch {r.micro_batch}: {plan.max_seq_len}",
    ]
    return "\n".join(lines)
