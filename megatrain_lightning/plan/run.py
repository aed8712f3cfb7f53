"""What the planner plans: a workload (the micro-batch and the step around it) under an EngineConfig."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import EngineConfig


@dataclass(frozen=True)
class Workload:
    """The micro-batch shape and the step around it: what a run trains on, not where it puts things."""

    micro_batch: int
    seq_len: int
    accumulate: int = 1
    loss_chunk_tokens: int | None = None  # None: Hugging Face's loss over all logits at once
    mlp_chunk_tokens: int | None = None  # None: each block's MLP over all tokens at once (models/chunked_mlp.py)
    bf16: bool = True  # compute dtype bf16 (slots stage fp32 then cast); False: fp32 everywhere
    clip: bool = False  # gradient clipping: the host step follows the backward (no overlap, no pool)

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def mlp_chunked(self) -> bool:
        """Whether the blocks' MLPs run in chunks (a micro-batch within one chunk runs them as they are)."""
        return self.mlp_chunk_tokens is not None and self.tokens > self.mlp_chunk_tokens


@dataclass(frozen=True)
class Run:
    """A workload under an engine config whose automatic choices are resolved (``grad_buffers`` and
    ``bf16_grads`` not None: see :func:`~megatrain_lightning.plan.fit.resolve`).

    ``compact_native`` and ``head_in_backward`` describe older engines, for comparisons with their runs:
    the compact update in torch ops (before commit 12283d1), one resident part (before 2f37add). ``tried``:
    the run's first steps measure and try a placement (see the field).
    """

    work: Workload
    engine: EngineConfig
    compact_native: bool = True
    head_in_backward: bool = True
    # The strategy places memory itself (open placement fields on a GPU): its first step is measured and its
    # choice tried on the next, neither with an overlapped update, so both gather block gradients in fp32
    # accumulators (4 B/param) where the steps after send bf16 ones (2 B/param): the host peak is theirs.
    tried: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", self.engine.filled())  # an open placement plans as streaming
        if self.engine.grad_buffers is None or self.engine.bf16_grads is None:
            raise ValueError("Run needs an EngineConfig with grad_buffers and bf16_grads resolved")

    def replace(self, **changes: object) -> Run:
        """A copy with Workload or EngineConfig fields (or this class's own) changed."""
        work = {k: v for k, v in changes.items() if k in {f.name for f in dataclasses.fields(Workload)}}
        eng = {k: v for k, v in changes.items() if k in {f.name for f in dataclasses.fields(EngineConfig)}}
        own = {k: v for k, v in changes.items() if k not in work and k not in eng}
        return dataclasses.replace(self, work=dataclasses.replace(self.work, **work),
                                   engine=dataclasses.replace(self.engine, **eng), **own)

    @property
    def compact(self) -> bool:
        return self.engine.host_state == "compact"

    @property
    def grad_buffers(self) -> int:
        assert self.engine.grad_buffers is not None
        return self.engine.grad_buffers

    @property
    def pooled_grads(self) -> bool:
        """Whether block gradients live in the pool rather than in full-size accumulators."""
        return self.work.accumulate == 1 and self.grad_buffers > 0 and not self.work.clip

    @property
    def half_grads(self) -> bool:
        """Whether block gradients travel and wait on the host as bf16 (straight into the overlapped update)."""
        return bool(self.engine.bf16_grads) and self.work.bf16 and self.work.accumulate == 1 and not self.work.clip

    def compiled(self) -> bool:
        """Whether the blocks run through torch.compile (``EngineConfig.compile_blocks``; None: under bf16, the
        planner planning a CUDA device; blocks with Hugging Face's experts compiled around them:
        ``engine/compiled.py``)."""
        return self.work.bf16 if self.engine.compile_blocks is None else self.engine.compile_blocks

    @property
    def update_on_device(self) -> bool:
        """Whether the part before the blocks and the first block are updated on the device
        (``EngineConfig.update_on_device``)."""
        return (bool(self.engine.update_on_device) and self.engine.overlap_optimizer and not self.compact
                and self.work.accumulate == 1 and not self.work.clip)

    def device_blocks(self, layers: int) -> int:
        """How many of ``layers`` blocks are updated on the device: the first, and cached ones up to the
        number ``update_on_device`` asks for (``engine/device_update.device_blocks``)."""
        return device_blocks(self.engine, layers) if self.update_on_device else 0

    def host_blocks(self, layers: int) -> list[int]:
        """The blocks whose AdamW runs on the host (every block not updated on the device), by index."""
        on_device = set(device_block_ids(self.engine, layers)) if self.update_on_device else set()
        return [b for b in range(layers) if b not in on_device]

    @property
    def run_on(self) -> bool:
        return self.engine.overlap_optimizer and self.engine.overlap_next_forward and not self.work.clip


def device_blocks(engine: EngineConfig, layers: int) -> int:
    """The blocks ``engine.update_on_device`` updates on the device where it applies: the first, and up to
    N - 1 cached ones (the first block, when cached, is one of them); 0 where it is off."""
    return len(device_block_ids(engine, layers))


def device_block_ids(engine: EngineConfig, layers: int) -> list[int]:
    """Which blocks those are, by index: the engine's rule (``EngineConfig.device_updated``) on the forward
    order 0, 1, ... and the cached blocks (``EngineConfig.fixed_blocks``)."""
    return engine.device_updated(range(max(layers, 0)), set(engine.fixed_blocks(layers)))
