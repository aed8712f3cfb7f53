"""EngineConfig: every placement and overlap choice of a MegaTrain run, typed, documented and validated here.

The strategy (``MegaTrainStrategy(engine=EngineConfig(...))``), the YAML (``conf/strategy/megatrain.yaml``,
key ``strategy.engine``), the engine and the planner all read this one object; nothing else sets a default.
Lightning-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

HostState = Literal["fp32", "compact"]
KeptSaves = Literal["all", "matmuls"]
SavedInputsDtype = Literal["input", "compute"]
HOST_STATES: tuple[str, ...] = ("fp32", "compact")
KEPT_SAVES: tuple[str, ...] = ("all", "matmuls")
SAVED_INPUTS_DTYPES: tuple[str, ...] = ("input", "compute")

# The placement fields: None means "choose for this run" (plan/placement.py; see EngineConfig).
PLACEMENT_FIELDS: tuple[str, ...] = ("slots", "keep_activations", "kept_saves", "cache_weights", "offload_inputs")
# What a None placement field becomes where nothing chooses: every block streamed, nothing kept or offloaded.
STREAMING = {"slots": 2, "keep_activations": 0, "kept_saves": "all", "cache_weights": 0, "offload_inputs": False}

# grad_buffers=None: the pool used when a run's own gradient accumulators would not leave a tenth of the host
# memory free (see grad_buffers_for).
AUTO_POOL = 4


@dataclass(frozen=True)
class EngineConfig:
    """How a run places its memory and overlaps its work. Every choice gives the same result bit for bit,
    except ``host_state``, ``saved_inputs_dtype`` and ``compile_blocks``; they trade device memory, host memory
    and link bytes for speed.

    The placement fields (``slots``, ``keep_activations``, ``kept_saves``, ``cache_weights``,
    ``offload_inputs``) default to None: chosen for the run. On one CUDA device, while fitting, the strategy
    runs the first micro-batch streaming and measures it (its device peak, the user's loss and logits
    included, and what one block's activations take), chooses from that, the device memory free at setup
    and, for a Hugging Face model, the planner's memory and time model (``plan/measured.py``), tries the
    choice on the next micro-batch and backs off if it does not fit, a step that runs out of memory running
    again (``auto_placement.py``); one log line names each choice. ``python -m megatrain_lightning.plan``
    prints the planner's own choice for a config (``plan/placement.py``). Elsewhere (the CPU, data parallel,
    evaluation alone) None is the streaming placement: 2 slots, nothing kept, cached or offloaded
    (:data:`STREAMING`). A value set explicitly is always used as it is.

    Args:
        slots: rotating device weight buffers (>= 2), one block each. Two double-buffer (block i+1 is
            copied while block i computes); more prefetch deeper.
        keep_activations: the last this-many blocks keep their activations on the device from forward to
            backward instead of being recomputed, and keep their weights in a fixed slot for the step. Each
            costs one block's activations at the micro-batch size (a 7B layer at 16 K tokens: ~3.5 GB) and
            saves a third of its device work and two weight copies per micro-batch. The last blocks are the
            ones to keep: their backward comes first, while the recomputed ones' copies are being issued.
            Clamped to the number of blocks.
        kept_saves: what a kept block holds: ``"all"`` its activations as autograd saves them;
            ``"matmuls"`` its input and its matmul and attention outputs only, the backward recomputing the
            elementwise ops from them (a few percent of the block's time; ``engine/selective.py``). A 7B
            layer then keeps ~121 instead of ~262 KB per token, so about twice as many blocks fit.
        cache_weights: ``max(cache_weights, keep_activations)`` blocks keep their compute-dtype weights on
            the device for the whole optimizer step (the last ones; those ``update_on_device`` updates from
            block 1 on: :meth:`fixed_blocks`): one host->device copy per step instead of two per micro-batch, at
            one block of weights each (a 7B layer: 0.47 GB in bf16). Clamped.
        offload_inputs: which recomputed blocks park their saved inputs in pinned host memory instead of on
            the device (each is one residual-stream activation: tokens x hidden x 4 B, 2 B with
            ``saved_inputs_dtype="compute"``), brought back one block ahead of its backward. ``True``: every
            recomputed block, so device memory stops growing with depth; ``N``: the first ``N`` blocks (the
            rest keep theirs on the device), the ones to offload because their backward comes last: their
            copies have the whole rest of the forward and backward to run. Each costs its bytes on the link
            both ways and in pinned host memory (torch's pinned allocator rounds each up to a power of two);
            ``False`` or 0: none. Clamped to the recomputed blocks; ``python -m megatrain_lightning.plan``
            names the smallest count that fits a run.
        saved_inputs_dtype: ``"input"``: saved block inputs keep their dtype (fp32: the residual stream stays
            fp32 under bf16 autocast). ``"compute"``: stored in the compute dtype (bf16 under bf16-mixed; a
            no-op in fp32), on the device or on the host: half the bytes of every saved input and of the
            offload copies. Not exact: the forward runs on the fp32 input, the recompute on its bf16
            rounding (relative error <= 2^-9 per element), so the backward's activations and gradients
            differ from the forward's by about the rounding bf16 autocast already applies inside the block
            (measured on a tiny Llama over 100 bf16-mixed steps: docs/long_context.md). Opt-in.
        host_state: ``"fp32"``: fp32 master, gradient and Adam moments, 16 B/param on the host.
            ``"compact"``: 12 B/param (8 lasting + the 4 B gradient): the fp32 master kept exactly as a bf16
            high half plus an int16 low half, bf16 Adam moments rounded stochastically. The module's
            parameters (``state_dict()``, checkpoints) are then bf16 and the low halves travel in the
            optimizer state; Adam/AdamW only. Over 200 fine-tuning steps its loss is within 0.01% of fp32
            state (docs/compact_state.md).
        grad_buffers: pinned gradient buffers (one block each) lent to blocks whose update overlaps the
            backward with nothing to accumulate: such a step keeps no full-size fp32 accumulator (4 B/param:
            30 GB at 7B); those blocks' ``.grad`` are None after the step. 0: every store keeps its own
            accumulator. The pool also bounds how far the device runs ahead of the host optimizer. ``None``:
            own accumulators when they fit the host memory with a tenth of it to spare (faster: 1.10 against
            1.22 s per 3B step on the H200 host), else a pool of 4 (:func:`grad_buffers_for`).
        host_threads: intra-op threads of the host worker (gradient adds, AdamW). ``None``: torch's
            default (all cores) less the cores other processes keep busy when the engine starts, at least
            one (``host_cores.py``: on a 2-core machine with one core busy, a clipped run went from 1,471
            to 11,855 tokens/s); on the idle 16-core H200 host that is all 16 (15 made the 3B step slower).
        bf16_grads: a block computed in bf16 whose gradients go straight into its overlapped update sends
            them home in bf16 and the host AdamW widens them: the same step bit for bit, half the
            device->host bytes and pinned gradient memory. ``None``: on where the one-pass host AdamW kernel
            builds (it widens in a register: 3B on the H200, 1.003-1.007 against 1.147-1.180 s per step),
            off without it (widening chunk by chunk cost more than it saved: 1.29 against 1.12 s).
        pin_memory: pin host masters and gradient buffers at their exact size for full-speed copies (55
            against 6.7 GB/s pageable on the H200). ``None``: pin when the device is CUDA.
        overlap_optimizer: update each block on the host as soon as its gradients land, while the backward
            goes on, whenever that is exact (one optimizer, automatic optimisation, no clipping, no hook
            between the backward and the step); otherwise the host step follows the backward.
        overlap_next_forward: let the updates the backward did not finish run on into the next forward,
            each block awaited before its weights go to the device; applies only while nothing but the
            engine can look at the weights between steps (see ``MegaTrainStrategy``).
        update_on_device: the updates the next forward waits for first run on the device, where their
            gradients are: the part before the blocks (the input embedding, a tied LM head with it; the
            device already holds an fp32 copy of its masters) and the first block (its new weights are cast
            into its slot); the same AdamW, the same step, so the next forward no longer waits for their
            gradient copies, host AdamW and weight copies. Where steps run on (``overlap_next_forward``),
            their newer masters and moments stay on the device until something reads the host state
            (checkpoints, validation, the end of fit: ``engine/device_update.py``, "home on demand"). ``True`` (or 1): those two; a number
            ``N`` > 1: also ``N - 1`` of the cached blocks (``cache_weights``; their new weights stay in their
            fixed slots; cached from block 1 on, :meth:`fixed_blocks`), each taking its AdamW off the host, for
            a run the host AdamW bounds. Costs the part's
            Adam moments on the device, 8 B/param, and each block's fp32 masters and moments, 12 B/param,
            plus one block's fp32 gradients while it is updated (7B, ``True``: 4.4 + 3.7 GB). Applies with
            the overlapped update, fp32 host state, one micro-batch per step and one rank; their parameters'
            ``.grad`` are then None after the step, as with pooled ``grad_buffers``. ``None``: chosen (off,
            ``True`` or ``N``) with the placement when the strategy chooses one (the planner's fastest step with
            the memory counted: ``N`` where the host AdamW bounds the step, e.g. 3B at 16 K tokens; off where
            the memory is worth more, e.g. at long context), off where the placement is set by hand or nothing
            chooses it (the CPU).
        compile_blocks: run each block's forward (and a kept block's selective recompute) through
            ``torch.compile``, its elementwise work (norms, rotary embedding, SwiGLU, casts, residual adds)
            fused by inductor (``engine/compiled.py``): one Qwen2.5-7B layer at 32 K tokens, forward +
            backward on the H200, 104.1 -> 78.3 ms saving matmul outputs, 92.4 -> 77.2 ms keeping all.
            Not bit for bit (fused kernels round differently: bf16, 4e-4 relative on a layer's output). Each
            block class compiles once (tens of seconds in the first steps; a new input shape compiles again);
            a function that fails to compile runs eager, with one warning. Hugging Face's grouped GEMM
            experts compile inside their block (Qwen3-30B-A3B on the H100: 169.7 -> 190.3 model TFLOPS), but
            biased ones (GPT-OSS's) and other ``*Experts`` run eager inside a compiled block (GPT-OSS-20B on the
            H200: 224.9 -> 256.9). ``None``: on a CUDA device under mixed precision (bf16/fp16), except blocks that
            route to experts without an ``*Experts`` module; off in fp32 (bit for bit with Lightning's default
            strategy) and on the CPU.
    """

    slots: int | None = None
    keep_activations: int | None = None
    kept_saves: KeptSaves | None = None
    cache_weights: int | None = None
    offload_inputs: bool | int | None = None
    saved_inputs_dtype: SavedInputsDtype = "input"
    host_state: HostState = "fp32"
    grad_buffers: int | None = None
    host_threads: int | None = None
    bf16_grads: bool | None = None
    pin_memory: bool | None = None
    overlap_optimizer: bool = True
    overlap_next_forward: bool = True
    update_on_device: bool | int | None = None
    compile_blocks: bool | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.slots is None:
            pass
        elif not isinstance(self.slots, int) or isinstance(self.slots, bool):
            problems.append(f"slots={self.slots!r}: a whole number of device slots, >= 2")
        elif self.slots < 2:
            problems.append(f"slots={self.slots!r}: at least 2 device slots are needed to overlap copies and compute")
        for name in ("keep_activations", "cache_weights"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                problems.append(f"{name}={value!r}: a number of blocks, >= 0")
        for name in ("bf16_grads", "pin_memory", "overlap_optimizer", "overlap_next_forward"):
            value = getattr(self, name)
            if not isinstance(value, bool) and (value is not None or name.startswith("overlap")):
                problems.append(f"{name}={value!r}: True or False" + ("" if name.startswith("overlap") else
                                                                       " (None: chosen for the machine)"))
        if self.kept_saves is not None and self.kept_saves not in KEPT_SAVES:
            problems.append(f"kept_saves={self.kept_saves!r}: expected one of {KEPT_SAVES}")
        if self.offload_inputs is None or isinstance(self.offload_inputs, bool):
            pass
        elif not isinstance(self.offload_inputs, int) or self.offload_inputs < 0:
            problems.append(f"offload_inputs={self.offload_inputs!r}: True (every recomputed block), False, or a "
                            "number of blocks >= 0 (the first ones)")
        if self.saved_inputs_dtype not in SAVED_INPUTS_DTYPES:
            problems.append(f"saved_inputs_dtype={self.saved_inputs_dtype!r}: expected one of {SAVED_INPUTS_DTYPES}")
        if self.host_state not in HOST_STATES:
            problems.append(f"host_state={self.host_state!r}: expected one of {HOST_STATES}")
        if self.grad_buffers is not None and (not isinstance(self.grad_buffers, int) or self.grad_buffers < 0):
            problems.append(f"grad_buffers={self.grad_buffers!r}: a number of pooled buffers, >= 0 (None: automatic)")
        if self.update_on_device is not None and (not isinstance(self.update_on_device, int) or self.update_on_device < 0):
            problems.append(f"update_on_device={self.update_on_device!r}: True, False, or a number of blocks >= 0 "
                            "(the first block and cached ones)")
        if self.host_threads is not None and (not isinstance(self.host_threads, int) or self.host_threads < 1):
            problems.append(f"host_threads={self.host_threads!r}: a number of threads, >= 1 (None: the free cores)")
        if self.compile_blocks is not None and not isinstance(self.compile_blocks, bool):
            problems.append(f"compile_blocks={self.compile_blocks!r}: True, False, or None (compiled on CUDA under "
                            "mixed precision)")
        if problems:
            raise ValueError("EngineConfig: " + "; ".join(problems))

    @property
    def unset(self) -> tuple[str, ...]:
        """The placement fields left to choose (None)."""
        return tuple(f for f in PLACEMENT_FIELDS if getattr(self, f) is None)

    @property
    def chosen_with_placement(self) -> tuple[str, ...]:
        """What a strategy choosing the placement chooses: the unset fields, and ``update_on_device`` if None."""
        return self.unset + (("update_on_device",) if self.unset and self.update_on_device is None else ())

    def filled(self) -> EngineConfig:
        """This config with every unset placement field at its streaming value (:data:`STREAMING`)."""
        return dataclasses.replace(self, **{f: STREAMING[f] for f in self.unset}) if self.unset else self

    def for_blocks(self, n_blocks: int) -> EngineConfig:
        """This config with the block counts clamped to a model of ``n_blocks`` blocks."""
        k, c = self.keep_activations, self.cache_weights
        return dataclasses.replace(self, keep_activations=None if k is None else min(k, n_blocks),
                                   cache_weights=None if c is None else min(c, n_blocks))

    def offloaded_blocks(self, n_blocks: int) -> int:
        """How many blocks park their saved inputs on the host: the first ones among the recomputed
        (the kept blocks, the last ``keep_activations``, save none). Open fields count as streaming."""
        e = self.filled()
        recomputed = max(n_blocks - min(e.keep_activations, n_blocks), 0)
        if isinstance(e.offload_inputs, bool):
            return recomputed if e.offload_inputs else 0
        return min(e.offload_inputs, recomputed)

    @property
    def cached_blocks(self) -> int:
        """Blocks whose weights stay on the device for the step (kept blocks included; open fields: none)."""
        e = self.filled()
        return max(e.keep_activations, e.cache_weights)

    def fixed_blocks(self, n_blocks: int) -> list[int]:
        """The :attr:`cached_blocks` of a model of ``n_blocks`` blocks, by index. The kept ones are the last
        ``keep_activations``. Of the others, those the device updates (``update_on_device=N``: the first block
        and N - 1 cached ones) are cached from block 1 on: their gradients land last in the backward, so left
        to the host their AdamW would run between the backward and the next forward, which waits for each in
        turn (measured on an H100, Qwen3-30B-A3B cut to 10 layers, 22 x 2048, blocks 6-9 cached and updated on
        the device: the GPU idle 40 % of the step, 0.54 s, the largest gaps in the forward's first blocks). The blocks
        the host updates are then the last ones, whose gradients land first, their AdamW beside the rest of
        the backward. Cached blocks left to the host are the last ones. Every choice gives the same result bit
        for bit (the placement moves weights, not arithmetic)."""
        cached = min(self.cached_blocks, n_blocks)
        if cached == n_blocks:
            return list(range(n_blocks))
        kept = min(self.filled().keep_activations, cached)
        early = min(cached - kept, max(int(self.update_on_device or 0) - 1, 0), max(n_blocks - 1 - kept, 0))
        return list(range(1, 1 + early)) + list(range(n_blocks - (cached - early), n_blocks))

    def device_updated(self, order: Sequence[int], fixed: Collection[int]) -> list[int]:
        """The blocks ``update_on_device=N`` updates on the device, of blocks run in the forward ``order`` with
        fixed weight slots ``fixed``: the forward's first block (the slot the backward read last keeps its new
        weights), then up to N - 1 blocks with fixed slots, in forward order. No other streamed block: its slot
        is refilled before the next forward needs it. The engine passes its recorded order and its slots, the
        planner ``range(n)`` and :meth:`fixed_blocks`."""
        n = int(self.update_on_device or 0)
        if n == 0 or not order:
            return []
        return list(order[:1]) + [b for b in order[1:] if b in fixed][: n - 1]


def grad_buffers_for(requested: int | None, host_need_bytes: float, host_total_bytes: float) -> int:
    """The one grad-buffer policy (engine at setup, planner ahead of time): ``requested`` when set; else 0
    (own accumulators) when the host footprint with them, ``host_need_bytes``, leaves a tenth of
    ``host_total_bytes`` free, else :data:`AUTO_POOL`."""
    if requested is not None:
        return requested
    return 0 if host_need_bytes <= 0.9 * host_total_bytes else AUTO_POOL
