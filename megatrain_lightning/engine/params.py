"""The module's own parameters, as the model (not the engine) treats them.

The engine owns where the parameters live; the model decides what they are: which train (frozen weights,
``requires_grad`` toggled, groups added to an optimizer), what is written to them between steps (an EMA
swap, ``load_state_dict``, ``p.data = ...``), where they are read (a loss term on a block's weight, a tie
that is not registered), and their dtype. What the engine does about each:

* :func:`make_trainable`: a parameter that starts to train gets its place in the trainable region of its
  store (the store is laid out again, between steps);
* :func:`reclaim`: weights written outside the optimizer are taken back into the stores, and every device
  copy is refreshed before its next use;
* :class:`OutsideUse`: a block parameter used outside its block gets the two shares of its gradient
  added, and its block is updated after the backward;
* :func:`upcast_buffers`: a module given in bf16 trains fp32 masters (one log line), its buffers follow.

The functions take the engine (:class:`~megatrain_lightning.engine.engine.StreamingEngine`) as ``engine``.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from torch import nn

from .phase import Phase, StepState
from .slots import BlockBinding
from .store import FlatStore

log = logging.getLogger(__name__)


def make_trainable(engine: Any, params: Sequence[nn.Parameter] = ()) -> bool:
    """Lay out again every store in which ``params``, or a parameter that now requires grad, sits in the
    frozen region (an optimizer holds it, or it was unfrozen), so that it gets a master, gradient and
    moments. Waits for the host updates first (nothing may write the old buffers meanwhile). Returns
    whether anything changed (the caller's host optimizers then bind the stores again)."""
    wanted = {id(p) for p in params}
    todo = [(key, store) for key, store in engine.keyed_stores()
            if any(id(p) in wanted or p.requires_grad for p in store.params[store.n_trainable :])]
    if not todo:
        return False
    engine.settle()  # host sync: every update has run, every gradient is home
    upcast = 0
    for key, store in todo:
        new = store.relayout({id(p) for p in store.params[: store.n_trainable]}
                             | {id(p) for p in store.params if id(p) in wanted or p.requires_grad})
        upcast += len(new.upcast)  # frozen in bf16/fp16 until now: fp32 masters from here on
        if key >= 0:
            engine.stores[key] = engine.weights.stores[key] = new
            binding = BlockBinding(engine.blocks[key], new.params)
            binding.device_buffers = engine.bindings[key].device_buffers
            engine.bindings[key] = binding
            engine.weights.relaid(key)
        else:
            engine.resident.relaid(key, new)
        engine.pins.release(store.buffers())
    if upcast > 0:  # as at setup (upcast_buffers' line): they train as fp32 masters, not in their own dtype
        log.info("megatrain_lightning: %d parameters held in bf16/fp16 became trainable and were upcast into fp32 "
                 "host masters (the host optimizer steps fp32 weights)", upcast)
    engine.grads.fit(engine.grad_numel(), max(s.train_numel for s in engine.stores))
    if engine.replicas.parallel:  # every rank laid the same stores out anew (at the same step): names go
        engine.replicas.node_barrier()
        engine.replicas.arena.seal()
        engine.updates.remote = {key: s for key, s in engine.keyed_stores() if not engine.owns(key)}
    return True


def reclaim(engine: Any) -> None:
    """Weights may have been written outside the optimizer (a callback's ``p.data.copy_``, an EMA swap,
    ``load_state_dict``, ``p.data = other``): a parameter whose ``.data`` is no longer its store view is
    copied back into it and re-pointed, and every device copy is refreshed before its next use. Version
    counters cannot tell: ``p.data.copy_`` bumps none. The same writers may re-register a block's parameters
    (pruning, a parametrization): refused by name (``BlockBinding.same_structure``)."""
    for i, binding in enumerate(engine.bindings):
        binding.same_structure(i)
    with torch.no_grad():
        for store in engine.all_stores():
            for p, view in zip(store.params, store.master_views):
                if p.data_ptr() != view.data_ptr() or p.shape != view.shape:
                    if _shares_memory(p):
                        _refuse_alias(engine, p)
                    view.copy_(p.detach().reshape(view.shape))
                    p.data = view
    engine.weights_changed()


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _shares_memory(p: torch.Tensor) -> bool:
    """Another tensor still holds the memory ``p.data`` was pointed at (``p.data = t`` with ``t`` kept): under the
    default strategy the two would train as one. Counted references: ``p``'s own and the storage object asked."""
    return _use_count is not None and _use_count(p.untyped_storage()._cdata) > 2


def _refuse_alias(engine: Any, p: torch.Tensor) -> None:
    name = next((n for n, q in engine.root.named_parameters(remove_duplicate=False) if q is p), type(p).__name__)
    raise ValueError(
        f"MegaTrainStrategy cannot train {name} exactly: its .data was set to a tensor that something else still "
        "holds (p.data = t with t kept, as ModelPruning's lottery-ticket reset keeps its copy of the first weights). "
        "Under Lightning's default strategy p and t would then share memory, and every later update of p would also "
        "change t; the strategy keeps p in its host store, so t would stay as it was. Copy the values instead "
        "(p.data.copy_(t), or p.data = t.clone()); with ModelPruning, use_lottery_ticket_hypothesis=False (or prune "
        "with the default strategy).")


def upcast_buffers(engine: Any) -> None:
    """Trainable parameters given in bf16/fp16 became fp32 masters (one log line says so); the module's
    floating buffers follow, so that the module computes as its fp32 self would."""
    dtypes = sorted({str(t.dtype) for s in engine.all_stores() for t in s.upcast_from})
    log.info("megatrain_lightning: %d trainable parameters held in %s were upcast into fp32 host masters "
             "(the host optimizer steps fp32 weights; %s keeps frozen ones as they are)",
             len(engine.upcast), ", ".join(dtypes), type(engine.root).__name__)
    for m in engine.root.modules():
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype in (torch.bfloat16, torch.float16):
                m._buffers[name] = b.float()
    for binding in engine.bindings:
        binding.refresh_buffers(engine.device)


class OutsideUse:
    """Watches block parameters for gradients that autograd accumulates on them directly.

    Inside the engine a block's weights are slot views, never leaves: a hook that fires on a block's
    host parameter means the model also used it outside the block's forward (a loss term on the weight, a
    tie that is not registered). Its gradient is added to the block's own when that is sent
    (``GradPath``), and the block is updated after the backward from then on, never early (``blocks``). A
    share that arrives after the block's own was sent (``sent``, this micro-batch) is refused.
    """

    def __init__(self, state: StepState, stores: Sequence[FlatStore], blocks: Sequence[nn.Module],
                 parallel: bool = False) -> None:
        self.state = state
        self.parallel = parallel
        self.stores = stores  # the engine's list (laid-out-again stores replace their entries)
        self.block_modules = blocks
        self.blocks: set[int] = set()  # blocks whose parameters the model also uses outside them
        self.sent: set[int] = set()  # blocks whose gradients went home in this micro-batch
        self._hooks = [p.register_post_accumulate_grad_hook(self._landed)
                       for s in stores for p in s.params if p.requires_grad]

    def _landed(self, param: torch.Tensor) -> None:
        if self.state.phase is Phase.IDLE and not self.state.step_open:
            return  # a plain host module outside any step
        block = next(i for i, s in enumerate(self.stores) if any(p is param for p in s.params))
        if self.parallel:  # the outside share is this rank's alone: the block's own is averaged over ranks
            raise RuntimeError(
                f"MegaTrainStrategy (data parallel): a parameter of streamed block {block} is used outside that "
                "block too, whose share of the gradient would not be averaged over the ranks. Register the tie "
                "as a shared parameter of a resident module, or compute the term inside the block.")
        self.blocks.add(block)
        if block in self.sent:
            module = self.block_modules[block]
            name = next((n for n, q in module.named_parameters() if q is param), f"of shape {tuple(param.shape)}")
            raise RuntimeError(
                f"MegaTrainStrategy: parameter {name} of streamed block {block} ({type(module).__name__}) got a "
                "gradient from outside that block after the block's own had gone home: the model reads it "
                "elsewhere before the block runs (a loss term on the weights computed before the forward, a tie "
                "that is not registered). Compute such a term after the forward, once the blocks have run (it "
                "then trains exactly), or use the optimizer's weight_decay for an L2 penalty; register a tie as a "
                "shared parameter of a resident module; or stream another level with block_class=...")

    def hook_ids(self) -> set[int]:
        """The keys of this watcher's own hooks in the parameters' ``_post_accumulate_grad_hooks``."""
        return {h.id for h in self._hooks}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
