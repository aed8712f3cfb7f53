"""What a Hugging Face model records from inside a streamed block (router logits, attentions), made
differentiable: extra outputs of the block's autograd Function.

How transformers 5 collects them: ``output_router_logits`` (and ``output_attentions``,
``output_hidden_states``) are gathered by forward hooks on submodules (the ``OutputRecorder`` entries of a
model's ``_can_record_outputs``: ``MixtralTopKRouter``, ``GptOssTopKRouter``...). Each hook appends its
module's output to a list in the dict held by one context variable,
``transformers.utils.output_capturing._active_collector``, which the model's ``@capture_outputs`` forward
sets up and then turns into ``outputs.router_logits``; ``load_balancing_loss_func`` reads those, and the
``*ForCausalLM`` adds ``router_aux_loss_coef`` times the result to ``outputs.loss``. A streamed block runs
its forward without autograd, so the logits its router's hook appends carry no gradient: the auxiliary
loss would not train the router, silently.

What is done instead (``block.py``): around a block's forward, :func:`capture` takes out of the collector
what the block's submodules appended and hands the tensors to the Function, which returns them as extra
outputs; :meth:`Recorded.put_back` appends those outputs to the collector in their places, so the loss is
built from tensors whose ``grad_fn`` is the block's backward. That backward recomputes the block under a
collector of the same shape (:func:`recompute`), takes the recorded tensors again, now with grad, and
differentiates them together with the block's outputs, with the gradients the loss sent to each. A kept
block (``keep_activations``) keeps them in its graph like its outputs.

Memory: nothing more than Lightning's default strategy holds (the recorded tensors live until the loss's
backward either way; the router logits of a layer are tokens x experts). Nothing here imports transformers:
a process that has not imported it has no collector, and a block then runs exactly as before.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any, Callable, Iterator, Sequence

import torch

_COLLECTOR_MODULE = "transformers.utils.output_capturing"
_TENSOR = object()  # marks an entry that travels as an extra output of the Function


def _collector_var() -> Any:
    """transformers' collector context variable (``get``/``set``/``reset``), or None where there is none."""
    module = sys.modules.get(_COLLECTOR_MODULE)
    return getattr(module, "_active_collector", None) if module is not None else None


def recorder_known() -> bool:
    """Whether this process's transformers records outputs through the collector this module reads (the
    strategy refuses a recorded router loss otherwise: its gradient would be lost)."""
    if _collector_var() is None:
        try:
            importlib.import_module(_COLLECTOR_MODULE)
        except ImportError:
            return False
    var = _collector_var()
    return var is not None and all(callable(getattr(var, m, None)) for m in ("get", "set", "reset"))


class Recorded:
    """The layout of what one block call appended to the collector, without the tensors themselves.

    ``before``: per list key, its length before the call (the recompute's collector has the same lengths,
    which transformers' hidden-state hook reads); ``entries``: per key, the new entries in order, tensors
    marked (they are the Function's extra outputs, in this order), anything else (a ``None`` placeholder)
    as it was. The collector's other values (a set of selected indices) are kept for the recompute.
    It lives as long as the block's graph, so it must not hold a tensor (nor the collector, which holds
    every layer's recorded tensors).
    """

    def __init__(self, collector: dict, before: dict[str, int], extras: dict[str, Any]) -> None:
        self.collector_id = id(collector)
        self.before = before
        self.extras = extras
        self.entries: dict[str, list[Any]] = {}
        self.n_tensors = 0
        self.put = False

    def put_back(self, tensors: Sequence[torch.Tensor]) -> None:
        """Append this call's entries to the active collector, the Function's outputs in place of the
        tensors the forward recorded (called once, as the Function returns)."""
        assert not self.put and len(tensors) == self.n_tensors
        self.put = True
        var = _collector_var()
        collector = var.get() if var is not None else None
        if collector is None or id(collector) != self.collector_id:
            raise RuntimeError(
                "a streamed block recorded outputs (router logits) into a transformers output collector that "
                "is no longer active when the block returns; MegaTrainStrategy cannot hand them back")
        it = iter(tensors)
        for key, entries in self.entries.items():
            collector[key].extend(next(it) if e is _TENSOR else e for e in entries)


def _split_new(collector: dict, before: dict[str, int], take: bool) -> tuple[dict[str, list[Any]], list[torch.Tensor]]:
    """The entries appended since ``before`` (removed from the collector with ``take``), and their tensors."""
    entries: dict[str, list[Any]] = {}
    tensors: list[torch.Tensor] = []
    for key, n in before.items():
        value = collector.get(key)
        if not isinstance(value, list) or len(value) <= n:
            continue
        new = value[n:]
        if take:
            del value[n:]
        entries[key] = [_TENSOR if isinstance(e, torch.Tensor) else e for e in new]
        tensors.extend(e for e in new if isinstance(e, torch.Tensor))
    return entries, tensors


def recording() -> bool:
    """Whether a collector is active and records something (router logits, attentions)."""
    var = _collector_var()
    return bool(var.get()) if var is not None else False


def capture(run: Callable[[], Any]) -> tuple[Any, Recorded | None, list[torch.Tensor]]:
    """``run()`` (a block's forward), and what its submodules recorded, taken out of the active collector.

    Returns ``(output, recorded, tensors)``; ``recorded`` is None when no collector is active or nothing
    was recorded (then the block runs as it always did).
    """
    var = _collector_var()
    collector = var.get() if var is not None else None
    if not collector:
        return run(), None, []
    before = {k: len(v) for k, v in collector.items() if isinstance(v, list)}
    extras = {k: v for k, v in collector.items() if not isinstance(v, list | torch.Tensor)}
    out = run()
    entries, tensors = _split_new(collector, before, take=True)
    if not entries:
        return out, None, []
    recorded = Recorded(collector, before, extras)
    recorded.entries = entries
    recorded.n_tensors = len(tensors)
    return out, recorded, tensors


def recompute(recorded: Recorded | None, run: Callable[[], Any], block: int) -> tuple[Any, list[torch.Tensor]]:
    """``run()`` (the block's recompute, with grad) under a collector shaped as in its forward; returns the
    output and the tensors recorded again, in the forward's order. A recompute that records something else
    than the forward did is an error (its gradients would not match the loss)."""
    if recorded is None:
        with silenced():
            return run(), []
    var = _collector_var()
    assert var is not None  # the forward found it
    collector: dict[str, Any] = {k: [None] * n for k, n in recorded.before.items()}
    collector.update(recorded.extras)
    token = var.set(collector)
    try:
        out = run()
    finally:
        var.reset(token)
    entries, tensors = _split_new(collector, recorded.before, take=False)
    if entries != recorded.entries:
        raise RuntimeError(
            f"block {block}'s recompute recorded other outputs than its forward "
            f"({ {k: len(v) for k, v in entries.items()} } vs { {k: len(v) for k, v in recorded.entries.items()} }): "
            "its forward is not deterministic in what it records, so MegaTrainStrategy cannot give the recorded "
            "tensors (router logits) their gradients. Set config.output_router_logits=False, or make the "
            "recording deterministic")
    return out, tensors


def traceable() -> bool:
    """Whether the active collector can be handed to a call compiled as one graph (:func:`in_one_graph`): what
    transformers records inside a block needs no length of what was recorded before (every key but
    ``hidden_states``, whose hook prepends the first layer's input to an empty list), through transformers'
    ``CompileableContextVar`` (its ``compiling`` and ``global_var``)."""
    var = _collector_var()
    collector = var.get() if var is not None else None
    return (bool(collector) and "hidden_states" not in collector
            and getattr(var, "compiling", None) is False and hasattr(var, "global_var"))


@contextlib.contextmanager
def in_one_graph() -> Iterator[None]:
    """The active collector, readable from inside one compiled graph, around a call compiled whole
    (``fullgraph``, no place to break at transformers' recording hook, which reads a ``ContextVar``).

    transformers' ``CompileableContextVar`` reads a plain attribute instead of its ``ContextVar`` while its
    ``compiling`` is set (what it does itself under a compiled model). The hooks inside the graph append to fresh
    empty lists (the lengths dynamo guards on are then the same at every layer: one compilation for all of
    them), the graph returns what they appended, and it is added to the collector's lists in order after the
    call, as the eager hooks would have appended it. Only where :func:`traceable`; both attributes are restored on
    any exit. Not thread-safe, as transformers' own compiled path is not: the engine makes one block call at a time
    (the forward's on the main thread, the backward's recomputes on autograd's, never both at once)."""
    var = _collector_var()
    collector = var.get()
    fresh = {k: [] if isinstance(v, list) else v for k, v in collector.items()}
    before = var.global_var, var.compiling
    var.global_var, var.compiling = fresh, True
    try:
        yield
    finally:
        var.global_var, var.compiling = before
    for key, value in fresh.items():
        if isinstance(value, list):
            collector[key].extend(value)


@contextlib.contextmanager
def silenced() -> Iterator[None]:
    """No collector while a block is run again for its gradients only (a recompute with nothing recorded,
    a kept block's selective recompute): its hooks must not append to a collector active around it."""
    var = _collector_var()
    if var is None or var.get() is None:
        yield
        return
    token = var.set(None)
    try:
        yield
    finally:
        var.reset(token)


def lengths() -> dict[str, int] | None:
    """The lengths of the active collector's lists (what a block's checked first call appends after), or None."""
    var = _collector_var()
    collector = var.get() if var is not None else None
    return {k: len(v) for k, v in collector.items() if isinstance(v, list)} if collector else None


def detach_since(before: dict[str, int] | None, drop: bool = False) -> list[torch.Tensor]:
    """The tensors appended to the active collector since ``before``, replaced there by detached copies (the
    checked first call builds a graph; what the Function returns has none), or removed with ``drop`` (a call that
    runs again appends them again). Returns them as they were, with their history."""
    var = _collector_var()
    collector = var.get() if var is not None and before is not None else None
    if not collector:
        return []
    _, tensors = _split_new(collector, before, take=False)
    for key, n in before.items():
        value = collector.get(key)
        if isinstance(value, list) and len(value) > n:
            value[n:] = [] if drop else [e.detach() if isinstance(e, torch.Tensor) else e for e in value[n:]]
    return tensors
