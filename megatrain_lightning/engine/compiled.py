"""Blocks run through ``torch.compile``: the block's own forward, its elementwise work fused by inductor.

A streamed step's device time beside the matmuls is mostly elementwise: the norms, rotary embedding, SwiGLU,
casts and residual adds of each block, several kernels each under eager autocast, run again in a kept block's
selective recompute. Inductor fuses them: one Qwen2.5-7B layer, forward + backward at 32 K tokens on the H200,
92.4 -> 77.2 ms with every activation kept and 104.1 -> 78.3 ms saving matmul outputs only (2026-12-04,
``recipes/fused_kernels.py``); a 3B layer 21.9 -> 14.0 ms. Not bit for bit: fused kernels round differently
(bf16: 4e-4 relative on a layer's output, the size of any kernel change).

What is compiled is the function the block's class defines, once per class (every block of a class shares
the compiled code: its parameters are inputs of the graph, which the engine binds to slot tensors), called
with the block's weights already bound (``block_call.run_bound``). A kept block that saves matmul outputs
only (``selective.py``) is compiled with its selective checkpoint inside, so that the partitioner, not a
replay in Python, recomputes the elementwise ops in the backward. Eager instead: a block's first call (it is
the one checked for buffer updates), a call while transformers records outputs (router logits: the
recording hooks' appends stay out of any graph), and a function whose compilation failed (one warning; the
run goes on eager, exactly as before). Random ops (dropout) draw from torch's generator as eager ones do
(inductor's ``fallback_random``): the masks are the eager module's, and a recompute replays its forward's.
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial
from typing import Any, Callable

import torch

from . import side_outputs
from .selective import saving_matmuls

log = logging.getLogger(__name__)

# What a compiled kept block saving matmul outputs holds over one keeping every activation (the first step
# measures the latter: its recompute runs compiled). Inductor already keeps fewer of the elementwise outputs, so
# the saving is smaller than eager's (~0.46 at 7B): 3.48 / 5.07 GiB for a Qwen2.5-7B layer at 32 K tokens, 1.00 /
# 1.47 for a 3B layer at 16 K (H200, 2026-12-04, recipes/fused_kernels.py).
COMPILED_MATMULS_RATIO = 0.69


def compiles_by_default(device: torch.device, compute_dtype: torch.dtype) -> bool:
    """``compile_blocks=None``: on a CUDA device under mixed precision, where kernels already round the
    compute (fp32 runs stay eager: bit for bit with Lightning's default strategy), for blocks without experts
    (:func:`has_experts`)."""
    return device.type == "cuda" and compute_dtype in (torch.bfloat16, torch.float16)


def has_experts(block: torch.nn.Module) -> bool:
    """Whether ``block`` routes tokens to experts (a Hugging Face ``*Experts`` module, or a router with
    ``num_experts``). Left eager unless ``compile_blocks=True``: compiled, GPT-OSS-20B's blocks (transformers'
    experts on ``_grouped_mm``) stopped on the H200 with the kernel's device-side assert (its group offsets
    must be multiples of 16 bytes; torch 2.11, 2026-12-04), and the routing's data-dependent shapes leave
    little to fuse."""
    return any(type(m).__name__.endswith("Experts") or hasattr(m, "num_experts") for m in block.modules())


class CompiledBlocks:
    """The compiled forwards of one engine's blocks. ``checked``: the engine's set of blocks whose first
    (eager, checked) call has run."""

    def __init__(self, enabled: bool, checked: set[int], eager: set[int] | None = None) -> None:
        self.enabled = enabled
        self.checked = checked
        self.eager = eager or set()  # blocks that stay eager (with experts, by default)
        self._compiled: dict[tuple[Callable[..., Any], bool], Callable[..., Any]] = {}
        self._failed: set[tuple[Callable[..., Any], bool]] = set()

    def runs(self, block: int, original: Callable[..., Any], matmuls_only: bool = False) -> bool:
        """Whether block ``block``'s next call (its class function ``original``; ``matmuls_only``: saving matmul
        outputs only) runs compiled."""
        return (self.enabled and block in self.checked and block not in self.eager
                and (original, matmuls_only) not in self._failed
                and not side_outputs.recording())

    def call(self, original: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict,
             matmuls_only: bool = False) -> Any:
        """``original(module, *args, **kwargs)`` compiled (with ``matmuls_only``: saving only matmul and attention
        outputs for the backward). Falls back to eager if compiling fails; a fallback under ``matmuls_only``
        runs without selective saving (this call's graph keeps every activation; later calls take the eager
        selective path, ``runs(..., matmuls_only=True)`` being False)."""
        key = (original, matmuls_only)
        fn = self._compiled.get(key)
        if fn is None:
            # fullgraph: a graph break inside the checkpoint would run it eager, and its recompute would then
            # run in the backward, after the block's weights were unbound; compiling whole or not at all
            fn = self._compiled[key] = (torch.compile(partial(saving_matmuls, original), fullgraph=True)
                                        if matmuls_only else torch.compile(original))
        try:
            with _checkpoint_side_effects_not_replayed(), _eager_random():
                return fn(module, *args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:
            self._failed.add(key)
            log.warning("torch.compile failed on %s%s (%s: %s); eager from here on",
                        getattr(original, "__qualname__", original), " saving matmul outputs" if matmuls_only else "",
                        type(err).__name__, (str(err).splitlines() or [""])[0][:300])
            return original(module, *args, **kwargs)


def _eager_random() -> Any:
    # Random ops (dropout) draw from torch's generator as eager ops do, not from inductor's own Philox streams:
    # the masks are then those of the eager module under Lightning's default strategy, and a streamed block's
    # recompute (another compiled graph than its forward's) replays its forward's masks from the restored RNG
    # state (block.RecomputeState), as in eager.
    import torch._inductor.config as inductor_config

    return inductor_config.patch(fallback_random=True)


def _checkpoint_side_effects_not_replayed() -> Any:
    # transformers' decoder layers (5.25, on the CPU) set a context variable in their forward, which dynamo refuses
    # inside a checkpointed region ("HOP: Unsafe side effect") unless told that the recompute need not replay it;
    # the recompute records nothing anyway (block.py silences it under eager selective saving too).
    config = torch._dynamo.config
    if hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        return config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
    return contextlib.nullcontext()
