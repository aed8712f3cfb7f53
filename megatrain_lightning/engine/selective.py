"""Selective saving for kept blocks: keep the outputs of matmuls and attention, recompute the rest.

A kept block (``keep_activations``) normally holds every activation autograd saves: for a Qwen2.5-7B
layer under bf16 autocast about 30h + 6kv + 8I bytes per token (fp32 norm inputs and outputs, the bf16
copies of the norm outputs, the SwiGLU's gate, up, activation and product...). Most of that is cheap to
recompute: only the matmuls and the attention kernel cost real device time. Run under torch's selective
activation checkpointing with this policy, a kept block saves its input and the outputs of those ops
(about 12h + 4kv + 4I bytes per token: less than half), and its backward recomputes the elementwise ops
(norms, rotary embedding, activation, casts, residual adds) from them: a few percent of the block's time
instead of the whole forward a recomputed block pays. About twice as many blocks then fit in the same
device memory.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# The ops worth saving: matmuls (the dense layers, under any autocast) and fused attention kernels.
SAVED_OPS = frozenset(
    getattr(_aten, name).default
    for name in (
        "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "convolution",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward", "_efficient_attention_forward",
    )
    if hasattr(_aten, name)
)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def saving_matmuls(fn: Callable[..., Any], *inputs: Any, **kwargs: Any) -> Any:
    """``fn(*inputs, **kwargs)`` with grad, saving only matmul and attention outputs (and ``inputs``) for the
    backward.

    The RNG state is restored for the recompute (dropout masks match) and so is autocast. Tensors ``fn``
    closes over (the block's weights) must keep their values until the backward has run. Eager, the
    backward calls ``fn`` again; under ``torch.compile`` (``compiled.py``) the compiled backward recomputes.
    """
    return checkpoint(
        fn,
        *inputs,
        use_reentrant=False,
        context_fn=partial(create_selective_checkpoint_contexts, _policy),
        preserve_rng_state=True,
        **kwargs,
    )
