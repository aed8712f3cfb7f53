"""What a call to a streamed block does: the ``forward`` the engine puts on each block.

Outside a step the block is a plain host module. In a step, a call without grad runs the block on its
streamed weights and returns; a call with grad goes through :class:`~.block.StreamedBlock`, which keeps
only the block's inputs and recomputes it in the backward. A Hugging Face decoder layer's KV cache is
switched off in calls with grad: the recompute must not append to it a second time (calls without grad,
``generate()``'s, run once and keep it).
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from typing import Any, Callable

import torch
from torch import nn

from .block import CallSpec, StreamedBlock
from .call_containers import refuse_hidden_grad_tensors
from .first_call import FirstCall
from .phase import Phase


def streamed_forward(engine: Any, index: int, block: nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
    """Block ``index``'s forward under ``engine`` (a :class:`~.engine.StreamingEngine`); ``original`` is
    its class's own ``forward``."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        state = engine.state
        if not state.step_open and state.phase is Phase.IDLE:
            return original(block, *args, **kwargs)  # outside a step: a plain host module
        # (in a step, or in its backward after the step function returned: a user's checkpoint recompute)
        if not torch.is_grad_enabled():  # runs once: a KV cache fills as without the strategy (generate())
            weights = engine.acquire(index)
            try:
                return engine.run_forward(index, args, kwargs, weights=weights)
            finally:
                engine.release(index)
        args, dropped = no_kv_cache(args, kwargs, index, block)
        if dropped and engine not in _told_of_cache:
            _told_of_cache.add(engine)
            warnings.warn(
                f"MegaTrainStrategy: block {index} ({type(block).__name__}) was handed a KV cache (use_cache=True) in "
                "a call with grad: streamed blocks do not fill it in training (the backward's recompute would append "
                "to it a second time), so the model's past_key_values come back empty. Pass use_cache=False (or set "
                "config.use_cache = False) to train without one; calls without grad (generate()) fill it as usual.",
                stacklevel=_caller_level())
        refuse_hidden_grad_tensors(index, block, args, kwargs)
        state.forward_call(index)  # the call order predicts the next micro-batch's prefetches
        spec = CallSpec(args, kwargs)
        if engine.meter.active:
            engine.meter.note_input([*args, *kwargs.values()])
        # Saved-tensor hooks that store what autograd stores without hooks: an outer activation checkpoint
        # (timm's, torch.utils.checkpoint around the block) records nothing of this call, so it never needs
        # to recompute it; the engine's own recompute stands in for it. A kept block builds its graph in
        # here too (block.py).
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            outs = StreamedBlock.apply(engine, index, spec, engine.anchor(), *spec.take_tensors())
        return spec.rebuild_output(outs)

    return forward


def run_bound(engine: Any, block: int, args: tuple, kwargs: dict, weights: Any = None,
              matmuls_only: bool = False, eager: bool = False) -> Any:
    """Block ``block``'s own forward with its parameters bound to ``weights`` (acquired, and released after,
    if None). Its first call (the forward, before any update ran) is checked: ``first_call.py``, and its buffers
    here. Compiled where ``engine.compiled`` runs it (``compiled.py``) unless ``eager``; ``matmuls_only``
    (compiled calls only): the compiled graph saves matmul and attention outputs only."""
    release = weights is None
    if weights is None:
        weights = engine.acquire(block)
    binding = engine.bindings[block]
    check = block not in engine.checked_blocks
    original = engine.original_forwards[block]
    first = FirstCall(engine, block, args, kwargs, weights) if check else None  # first_call.py
    try:
        with binding.bound(first.bound if first is not None else weights, check=check):
            if first is not None:  # eager, with a graph like its recompute's, checked
                out = first(lambda a, kw: original(engine.blocks[block], *a, **kw))
            elif not eager and engine.compiled.runs(block, original, matmuls_only):
                out = engine.compiled.call(block, original, engine.blocks[block], args, kwargs, matmuls_only)
            else:
                out = original(engine.blocks[block], *args, **kwargs)
        if binding.written:
            raise RuntimeError(
                f"MegaTrainStrategy cannot train block {block} ({type(engine.blocks[block]).__name__}) exactly: its "
                f"forward writes its parameter{'s' if len(binding.written) > 1 else ''} "
                f"{', '.join(binding.written_params())} in place or through .data (nn.Embedding(max_norm=...) "
                "renormalises its weight so; a clamp_ under no_grad; a projection assigned to .data), but a streamed "
                "block runs on a device copy of its weights that lives for one call: the write would never reach the "
                "weights the optimizer updates, and the backward's recompute would write again. Make the write "
                "outside the forward, on the weights themselves (in on_train_batch_end, or an optimizer step "
                "post-hook), use F.embedding without max_norm (or renormalise the rows it looks up without writing "
                "them back), or stream another level with "
                "block_class=... so that the module is resident.")
        if check:
            if first is not None and first.complete:
                engine.checked_blocks.add(block)
            changed = binding.mutated_buffers()
            if changed:
                raise RuntimeError(
                    f"MegaTrainStrategy cannot train block {block} ({type(engine.blocks[block]).__name__}) exactly: "
                    f"its forward changes its buffers in place or replaces them ({', '.join(changed)}), and a "
                    "streamed block runs its forward again in the backward's recompute (from the buffers it started "
                    "with; a replaced one is not kept). Make the buffers constant (a norm: track_running_stats=False; "
                    "spectral_norm's power iteration: weight_norm instead, or the module outside the streamed "
                    "blocks), or stream another level with block_class=...")
        return out
    finally:
        if release:
            engine.release(block)


def _pack(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    # Detached, as autograd saves a tensor itself: a node saving its own output (attention's, tanh's) gets the
    # output with its grad_fn here, and holding that would make a cycle through C++ that Python's garbage
    # collector cannot see: a kept block's graph whose backward never runs (a step that raised) would never
    # be freed. The unpacked output gets its grad_fn back from the node that saved it. With its version, as
    # autograd keeps one (hooks turn its own check off): the detached tensor shares the original's counter.
    return t.detach(), t._version


def _unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    t, version = packed
    if t._version != version:
        raise RuntimeError(
            f"MegaTrainStrategy: a tensor of shape {tuple(t.shape)} that a streamed block saved for its backward "
            "(one of its inputs, which its recompute starts from, or an activation a kept block saved) was changed "
            "in place after the block's forward, so its backward would read the new values (autograd refuses the "
            "same where it saved the tensor itself; a streamed block saves its inputs too). Write the new values "
            "into a new tensor (x = torch.full_like(x, v), not x.fill_(v)) once the block has run.")
    return t


_told_of_cache: "weakref.WeakSet[Any]" = weakref.WeakSet()  # engines whose run was warned of a dropped KV cache
_OWN_FILES = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))  # torch's, this package's
_LAYER_CALL = os.path.join("transformers", "modeling_layers.py")  # GradientCheckpointingLayer.__call__ (5.17 has one)


def _caller_level() -> int:
    """The ``stacklevel`` of a warning from a block's forward that names the code calling the block (the model's),
    past this package's frames, torch's module call machinery and transformers' layer ``__call__``."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(_OWN_FILES)
                                 or frame.f_code.co_filename.endswith(_LAYER_CALL)):
        frame, level = frame.f_back, level + 1
    return level


def no_kv_cache(args: tuple, kwargs: dict, index: int, block: nn.Module) -> tuple[tuple, bool]:
    """A call with grad to a Hugging Face layer: its recompute in the backward must not append to a KV cache a
    second time (its attention would run over the forward's keys and the recompute's, the forward's detached:
    silently wrong gradients). ``kwargs``'s cache keywords and any transformers ``Cache`` among ``args`` or
    ``kwargs`` become None (GPT-2, ImageGPT and others pass the cache by position), in place for ``kwargs``;
    returns the args and whether a cache was dropped (the model's output cache stays empty: the caller warns).
    A cache that already holds tokens (prefix tuning's virtual tokens, a continued sequence) is what the layer
    attends to: refused, since the block's inputs would not carry its gradient."""
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    cache_utils = sys.modules.get("transformers.cache_utils")  # no Cache object exists before it is imported
    caches = [v for v in (*args, *kwargs.values()) if cache_utils is not None and isinstance(v, cache_utils.Cache)]
    for cache in caches:
        try:
            held = cache.get_seq_length()
        except Exception:  # noqa: BLE001 -- a cache type that cannot say (a hybrid model's): treated as empty
            held = 0
        if held:
            raise RuntimeError(
                f"MegaTrainStrategy cannot train streamed block {index} ({type(block).__name__}) exactly: it is "
                f"handed a KV cache that already holds {held} tokens ({type(cache).__name__}: peft's prefix tuning, "
                "or training on a continuation with past_key_values), whose keys and values a streamed block "
                "cannot differentiate through. Train without past key values (peft: LoRA or prompt tuning "
                "instead of prefix tuning), or with the default strategy.")
    for key in ("past_key_values", "past_key_value", "cache", "layer_past"):
        if key in kwargs:
            kwargs[key] = None
    for key, value in kwargs.items():
        if any(value is c for c in caches):
            kwargs[key] = None
    if caches:
        args = tuple(None if any(a is c for c in caches) else a for a in args)
    return args, bool(caches)
