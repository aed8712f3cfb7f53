"""The user's optimizer, stepped on the host master weights.

The optimizer that ``configure_optimizers`` returns stays the object the user and their LR schedulers
see: its ``param_groups`` hold the hyperparameters, its ``state`` the per-parameter state, its
``state_dict()`` the usual format (a checkpoint loads into a plain ``torch.optim.AdamW`` and back).

* Adam, AdamW and :class:`HostAdamW` (without ``amsgrad``) take the fast path: their moments live in the
  host store's flat buffers (``state[p]["exp_avg"]`` is a view of them) and each (store, param group)
  range is updated by one kernel call (``kernels.py``).
* Any other ``torch.optim`` optimizer runs its own ``step()``: the parameters it holds are the module's
  parameters, which are the fp32 host masters, and their ``.grad`` are views of the host accumulators.

With ``host_state="compact"`` stores only the fast path exists (other optimizers are refused). The
moments are bf16 (``state[p]["exp_avg"]`` and ``["exp_avg_sq"]`` are bf16 views, saved as such), and
``state[p]["master_low"]`` is an int16 view of the low half of the fp32 master, so that a checkpoint
resumes exactly: the model's ``state_dict()`` holds the bf16 high half. A plain ``torch.optim.AdamW``
loads such a state dict too (moments cast to its parameters' dtype, ``master_low`` unused).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from itertools import chain
from typing import Any, Callable, Collection, Iterable, Iterator, Sequence

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from ..attached import method_of
from ..engine.store import FlatStore
from . import kernels
from .adam import AdamHyper, Piece, step_fp32


class HostAdamW(torch.optim.AdamW):
    """AdamW for host-resident parameters: fused (one vectorised pass, all cores) by default.

    Under :class:`~megatrain_lightning.MegaTrainStrategy` it is stepped over the flat host buffers.
    Anywhere else it is ``torch.optim.AdamW(..., fused=True)``, so a module that returns it trains the
    same with any strategy. Same arguments and defaults as ``torch.optim.AdamW`` (no ``amsgrad``).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        maximize: bool = False,
    ) -> None:
        params = list(params)
        on_cpu = all(
            (p["params"] if isinstance(p, dict) else [p])[0].device.type == "cpu" for p in params[:1]
        )
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize,
                         fused=True if on_cpu else None)


def is_fast_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Adam-family optimizers whose update the flat host kernels reproduce: Adam, AdamW and subclasses that
    keep their ``step`` (a subclass with its own, e.g. gradient centralisation, runs it: the generic path)."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return False
    if type(optimizer).step not in (torch.optim.Adam.step, torch.optim.AdamW.step):
        return False
    return not any(
        g.get("amsgrad") or g.get("differentiable") or g.get("capturable") for g in optimizer.param_groups
    )


def _why_not_fast(optimizer: torch.optim.Optimizer) -> str:
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return ""
    if type(optimizer).step not in (torch.optim.Adam.step, torch.optim.AdamW.step):
        return " (a subclass with its own step(), which the flat kernels would not run)"
    return " with amsgrad (or differentiable/capturable)"


class _Range:
    """The parameters of one param group inside one store: what one kernel call updates."""

    def __init__(self, store: FlatStore, indices: list[int]) -> None:
        self.store = store
        self.indices = indices
        self.params = [store.params[i] for i in indices]
        self._views: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None] | None = None

    def state_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-parameter views of the store's Adam moments (allocated on first use) and, for compact
        stores, of the master's low half: what ``optimizer.state[p]`` holds."""
        if self._views is None:
            ea, eas = self.store.moment_buffers()
            low = self.store.master_low
            views = self.store.train_views
            self._views = views(ea), views(eas), views(low) if low is not None else None
        return self._views

    def ensure_state(self, st: dict[str, Any], i: int, device_moments: Sequence[torch.Tensor] = (),
                     zero: bool = True) -> dict[str, Any]:
        """A parameter's Adam state on its first step: views of the store's moments (and low half), zeroed
        as torch starts them (the buffers may hold an earlier state: one a user's ``optimizer.state.clear()``
        or a tuner's restore of a state-less checkpoint emptied). ``device_moments``: the flat device copies
        of the moments an update on the device reads instead (their slice is zeroed too). ``zero`` False:
        views of what the buffers hold (data parallel: the state another rank of the node updates)."""
        if not st:
            ea, eas, low = self.state_views()
            # data parallel: the step count is the node's shared one (any rank's state is the owner's)
            counts = self.store.step_counts
            if counts is not None and zero:
                counts[i].zero_()
            st["step"] = counts[i] if counts is not None else torch.tensor(0.0)
            st["exp_avg"] = ea[i].zero_() if zero else ea[i]
            st["exp_avg_sq"] = eas[i].zero_() if zero else eas[i]
            start = self.store.layout.offsets[i]
            for m in device_moments:
                m[start : start + ea[i].numel()].zero_()
            if low is not None:
                st["master_low"] = low[i]  # the weight's low half, not optimizer state: kept
        return st

    def pieces(self, state: dict[Any, Any]) -> list[Piece]:
        """The one span builder: this step's pieces of the range, every step count incremented once.

        One piece per parameter with a gradient (as torch: a parameter without one is not updated, not
        even decayed): the store's bf16 gradients when it holds them, else ``p.grad`` flattened. On a
        compact store, consecutive parameters whose gradients are the store's own buffer and whose step
        counts agree form one span, which passes its first parameter's step to the kernel (the kernel then
        runs over the alignment padding between them: zeros that stay zero).
        """
        store = self.store
        offsets = store.layout.offsets
        own = store.grad_views if store.grad is not None else None
        src = store.half_grad if store.half_grad is not None else store.grad  # the store's own gradients
        wide = store.wide_train_views(store.half_wide) if store.half_wide is not None else {}
        out: list[Piece] = []
        steps: list[torch.Tensor] = []
        last: tuple[int, bool] | None = None  # (layout index, own gradient?) of the last parameter taken
        for i, p in zip(self.indices, self.params):
            start, end = offsets[i], offsets[i] + p.numel()
            if store.half_grad is not None and i in wide:  # fp32, beside the bf16 ones (FlatStore.hold_half_grad)
                grad, is_own = wide[i].view(-1), False
            elif store.half_grad is not None:
                grad, is_own = store.half_grad[start:end], True
            elif p.grad is None:
                continue
            elif own is not None and p.grad is own[i]:
                grad, is_own = own[i].view(-1), True
            else:
                grad, is_own = p.grad.detach().reshape(-1).to(torch.float32), False
            step = self.ensure_state(state[p], i)["step"]
            steps.append(step)
            if (store.compact and is_own and last is not None and last == (i - 1, True)
                    and float(out[-1].step) == float(step)):
                assert src is not None
                out[-1] = Piece(out[-1].start, end, src[out[-1].start : end], out[-1].step)
            else:
                out.append(Piece(start, end, grad, step))
            last = (i, is_own)
        if steps:  # none when no parameter of the range has a gradient (training_step returned None, a dropped layer)
            torch._foreach_add_(steps, 1)
        return out

    def device_pieces(self, state: dict[Any, Any], grads: Sequence[torch.Tensor | None], device: torch.device,
                      moments: Sequence[torch.Tensor]) -> list[Piece]:
        """:meth:`pieces` for an update on the device: ``grads`` are device tensors in layout order, ``moments``
        the flat device moments it updates; the host step counts are incremented as there, the kernel reads
        device copies of them."""
        offsets = self.store.layout.offsets
        out: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        for i, p in zip(self.indices, self.params):
            g = grads[i]
            if g is not None:  # as torch: a parameter without a gradient is not updated, not even decayed
                step = self.ensure_state(state[p], i, moments)["step"]
                out.append((offsets[i], offsets[i] + p.numel(), g.reshape(-1), step))
        if out:
            torch._foreach_add_([step for *_, step in out], 1)
        if device.type == "cpu":
            return [Piece(a, b, g, step) for a, b, g, step in out]
        # the kernel reads its step count on the device: a pinned copy, queued (a pageable one would wait
        # for the whole backward)
        return [Piece(a, b, g, step.pin_memory().to(device, non_blocking=True)) for a, b, g, step in out]


class HostOptimizer:
    """Steps ``optimizer`` on the host store.

    Args:
        optimizer: the user's optimizer; its params must be parameters of the streamed model.
        stores: the engine's flat stores (blocks and resident parts).
        on_zero_grad: told of every ``optimizer.zero_grad(set_to_none)``, so gradients the engine holds
            aside during a step are cleared too.
        around_load: (before, after), called around every ``optimizer.load_state_dict``: before, nothing may
            update the state any more (the engine settles); after, the masters and moments the device holds
            are refreshed from the host.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, stores: Sequence[FlatStore],
                 on_zero_grad: Callable[[bool], None] | None = None,
                 around_load: tuple[Callable[[], None], Callable[[], None]] | None = None) -> None:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "MegaTrainStrategy cannot step torch.optim.LBFGS: it evaluates the loss again inside its step (its "
                "closure runs forward and backward several times), where the strategy steps the host masters once "
                "after the backward. Use another optimizer, or train with Lightning's default strategy.")
        self.optimizer = optimizer
        self._own_zero_grad = optimizer.__dict__.get("zero_grad")  # put back by close()
        if on_zero_grad is not None:
            chain_zero_grad(optimizer, on_zero_grad)
        self._around_load = around_load
        self.fast = is_fast_adam(optimizer)
        self.compact = any(s.compact for s in stores)
        if self.compact and not self.fast:
            raise ValueError(
                f"host_state='compact' keeps bf16 Adam moments and steps them with its own kernel, so it "
                f"supports torch.optim.Adam, torch.optim.AdamW and HostAdamW (without amsgrad) only, not "
                f"{type(optimizer).__name__}{_why_not_fast(optimizer)}. "
                "Use EngineConfig(host_state='fp32') for other optimizers."
            )
        self.early_updates = 0  # stores updated as their gradients landed, over the run (for tests and logs)
        # host seconds in this optimizer's updates, over the run: the overlapped ones (host worker) and step()'s
        # (recipes/profile_breakdown.py reports it per step as the host optimizer's busy time; a diagnostic only,
        # added to from both threads without a lock)
        self.update_seconds = 0.0
        self.ranges: list[list[_Range]] = []
        self._bound_groups: list[list[int]] = []
        self.bind(stores)
        # A load_state_dict from anywhere (a checkpoint, a tuner's restore, the user's own call) builds fresh
        # state tensors: they move into the store after it. Compact: torch's load casts every state tensor to its
        # parameter's dtype (bf16), which would round the int16 low halves: set aside before, put back after.
        self._held_low: dict[int, torch.Tensor] = {}
        self._hooks = [optimizer.register_load_state_dict_pre_hook(self._hold_low_halves),
                       optimizer.register_load_state_dict_post_hook(self._restore_low_halves)]

    def params(self) -> list[torch.Tensor]:
        """Every parameter the optimizer holds, in its param groups (those added later included)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def bind(self, stores: Sequence[FlatStore]) -> None:
        """Map every param group onto the stores (at setup; again when a group was added or a store laid
        out again): ``ranges[g]`` holds, per store, the layout indices of group g's parameters."""
        where: dict[int, tuple[FlatStore, int]] = {}
        for store in stores:
            for i, p in enumerate(store.params):
                where[id(p)] = (store, i)
        missing = [p for p in self.params() if id(p) not in where]
        if missing:
            raise ValueError(
                f"{type(self.optimizer).__name__} holds {len(missing)} tensors that are not parameters of the "
                "LightningModule; MegaTrainStrategy keeps optimizer state for the module's parameters only. "
                "Build the optimizer from `self.parameters()` (or subsets of it) in configure_optimizers."
            )
        assert all(where[id(p)][1] < where[id(p)][0].n_trainable for p in self.params()), \
            "the engine lays the optimizer's parameters out in the trainable region"
        self.ranges = []
        for group in self.optimizer.param_groups:
            per_store: dict[int, tuple[FlatStore, list[int]]] = {}
            for p in group["params"]:
                store, i = where[id(p)]
                per_store.setdefault(id(store), (store, []))[1].append(i)
            self.ranges.append([_Range(s, sorted(ix)) for s, ix in per_store.values()])
        self._bound_groups = [list(map(id, g["params"])) for g in self.optimizer.param_groups]
        if self.fast:
            self.adopt_state()
        if any(s.step_counts is not None for s in stores):
            if not self.fast:
                raise ValueError(
                    f"MegaTrainStrategy under data parallel steps Adam/AdamW on the node's shared host state, "
                    f"each store by the rank that owns it; {type(self.optimizer).__name__} runs its own step() "
                    "over every parameter. Use torch.optim.AdamW or Adam (without amsgrad), or one device.")
            self.share_states()

    def share_states(self) -> None:
        """Data parallel: every rank's ``optimizer.state`` holds every parameter's, as views of the node's shared
        buffers, so that any rank's state dict (the checkpoint's) is whole; the owner of a store alone updates
        it, so a state emptied since (``state.clear()``) comes back only in the owner's, but for this."""
        for ranges in self.ranges:
            for r in ranges:
                for i, p in zip(r.indices, r.params):
                    r.ensure_state(self.optimizer.state[p], i, zero=False)

    def groups_changed(self) -> bool:
        """Whether the param groups (or their parameters) changed since :meth:`bind` (``add_param_group``)."""
        return [list(map(id, g["params"])) for g in self.optimizer.param_groups] != self._bound_groups

    # ------------------------------------------------------------------ state
    def adopt_state(self) -> None:
        """Move any existing Adam state into the flat buffers and make ``state[p]`` views of them.

        Called at setup and after ``load_state_dict`` (which builds fresh tensors). Compact stores: a
        ``master_low`` in the state is the fp32 master's low half (a checkpoint of a compact run); a state
        without one (an fp32 run's) leaves the weight at its bf16 value (low half zero).
        """
        if not self.fast:
            return
        state = self.optimizer.state
        for ranges in self.ranges:
            for r in ranges:
                ea_views, eas_views, low_views = r.state_views()
                for i, p in zip(r.indices, r.params):
                    st = state.get(p)
                    if not st:
                        continue
                    with torch.no_grad():
                        ea_views[i].copy_(st["exp_avg"])
                        eas_views[i].copy_(st["exp_avg_sq"])
                        if low_views is not None:
                            held = st.get("master_low")
                            if held is None:
                                low_views[i].zero_()
                            else:
                                low_views[i].copy_(held)
                            st["master_low"] = low_views[i]
                    step = st["step"]
                    step = (step if isinstance(step, torch.Tensor) else torch.tensor(float(step))).to(
                        device="cpu", dtype=torch.float32)
                    counts = r.store.step_counts
                    if counts is not None:  # data parallel: into the node's shared count
                        if counts[i].data_ptr() != step.data_ptr():
                            counts[i].copy_(step)
                        step = counts[i]
                    st["step"] = step
                    st["exp_avg"] = ea_views[i]
                    st["exp_avg_sq"] = eas_views[i]

    def close(self) -> None:
        """The strategy lets go of the optimizer (teardown, or the optimizer was replaced): its hooks and
        its chained ``zero_grad`` go."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.optimizer.__dict__.pop("zero_grad", None)
        if self._own_zero_grad is not None:
            self.optimizer.zero_grad = self._own_zero_grad

    def _hold_low_halves(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any] | None:
        """load_state_dict pre-hook: nothing updates the state any more; compact: take the int16 ``master_low``
        tensors out before torch casts them."""
        if self._around_load is not None:
            self._around_load[0]()
        if not self.compact:
            return None
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in optimizer.param_groups for p in g["params"]]
        by_id = dict(zip(ids, params))
        states = {}
        for key, st in state_dict["state"].items():
            if isinstance(st, dict) and "master_low" in st:
                st = dict(st)
                low = st.pop("master_low")
                if key in by_id:
                    self._held_low[id(by_id[key])] = low
            states[key] = st
        return {**state_dict, "state": states}

    def _restore_low_halves(self, optimizer: torch.optim.Optimizer) -> None:
        """load_state_dict post-hook: the held low halves go back, unconverted, and all state moves into the store."""
        held, self._held_low = self._held_low, {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                low = held.get(id(p))
                if low is not None and optimizer.state.get(p):
                    optimizer.state[p]["master_low"] = low
        self.adopt_state()  # into the store now, whoever called load_state_dict
        if self._around_load is not None:
            self._around_load[1]()

    # ------------------------------------------------------------------ step
    def pre_step_hooks(self) -> None:
        """The optimizer's step pre-hooks (global ones first), where Lightning's default strategy runs them:
        its ``optimizer.step(closure)`` runs them before the closure (the training step, zero_grad and the
        backward), so they see the gradients of the step before. The strategy calls this before the closure,
        and :meth:`step` does not run them again."""
        opt = self.optimizer
        for hook in chain(list(_global_optimizer_pre_hooks.values()), list(opt._optimizer_step_pre_hooks.values())):
            hook(opt, (), {})

    def step(self, skip: Collection[int] = ()) -> None:
        """One optimizer step on the host, with the optimizer's step post-hooks run after it as ``step()``
        would (its pre-hooks ran before the closure: :meth:`pre_step_hooks`).

        Stores whose ids are in ``skip`` were handed to an :meth:`overlap_update` of this step: they are
        updated already, or will be by the time the engine next uses them.
        """
        opt = self.optimizer
        if not self.fast:
            assert not skip
            t0 = time.perf_counter()
            with _without_pre_hooks(opt):
                step_without_closure(opt)  # the optimizer's own step, its post-hooks included
            self.update_seconds += time.perf_counter() - t0
            return
        t0 = time.perf_counter()
        with torch.no_grad():
            for group, ranges in zip(opt.param_groups, self.ranges):
                hyper = self.hyper(group)
                for r in ranges:
                    if id(r.store) not in skip:
                        kernels.update(r.store, r.pieces(opt.state), hyper)
        self.update_seconds += time.perf_counter() - t0
        self.early_updates += len(skip)
        for hook in chain(opt._optimizer_step_post_hooks.values(), _global_optimizer_post_hooks.values()):
            hook(opt, (), {})
        if hasattr(opt.step, "_wrapped_by_lr_sched"):
            opt._opt_called = True  # what the LR scheduler's step wrapper records; it is bypassed here

    def can_overlap(self) -> bool:
        """Whether stores may be updated one by one as their gradients land (no pre-step hook to honour)."""
        opt = self.optimizer
        return self.fast and not _global_optimizer_pre_hooks and not opt._optimizer_step_pre_hooks

    def has_post_hooks(self) -> bool:
        """Whether a step post-hook runs after :meth:`step` (it may write the host masters: weight clipping)."""
        return bool(_global_optimizer_post_hooks or self.optimizer._optimizer_step_post_hooks)

    def can_defer(self) -> bool:
        """Whether those updates may also run on after :meth:`step` returns: no post-step hook either
        (it must see every update done)."""
        return self.can_overlap() and not self.has_post_hooks()

    def overlap_update(self) -> StoreUpdate:
        """The update of one store, to run on the host worker as soon as its gradients are final.

        The hyperparameters are read now, as the backward starts (after the user's training step and the
        hooks before the backward, which may set them): the update may run after the LR scheduler has already
        stepped (updates run on into the next forward). The caller passes the stores it ran this on to
        :meth:`step` as ``skip``.
        """
        return StoreUpdate(self, [self.hyper(g) for g in self.optimizer.param_groups])

    def hyper(self, group: dict[str, Any]) -> AdamHyper:
        beta1, beta2 = group["betas"]
        return AdamHyper(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            decoupled=isinstance(self.optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False)),
            maximize=bool(group.get("maximize", False)),
        )


class StoreUpdate:
    """One step's overlapped update of a store, ``update(store)`` on the host worker, with the
    hyperparameters read as the step's backward starts."""

    def __init__(self, host: HostOptimizer, hypers: list[AdamHyper]) -> None:
        self.host = host
        self.hypers = hypers

    def __call__(self, store: FlatStore) -> None:  # host worker thread
        t0 = time.perf_counter()
        state = self.host.optimizer.state
        with torch.no_grad():
            for hyper, ranges in zip(self.hypers, self.host.ranges):
                for r in ranges:
                    if r.store is store:
                        kernels.update(store, r.pieces(state), hyper)
        self.host.update_seconds += time.perf_counter() - t0

    def on_device(self, store: FlatStore, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  grads: Sequence[torch.Tensor | None]) -> None:
        """The same update on device copies of ``store``'s trainable region (``engine/device_update.py``):
        flat fp32 ``master`` and moments, ``grads`` its parameters' device gradients in layout order."""
        state = self.host.optimizer.state
        with torch.no_grad():
            for hyper, ranges in zip(self.hypers, self.host.ranges):
                for r in ranges:
                    if r.store is store:
                        step_fp32(master, exp_avg, exp_avg_sq, r.device_pieces(state, grads, master.device, (exp_avg, exp_avg_sq)), hyper)

    @staticmethod
    def prefers_half_grads() -> bool:
        """Asked by the engine for ``bf16_grads=None``: bf16 gradients pay where the one-pass kernel builds."""
        return kernels.half_grads_pay()


def step_without_closure(opt: torch.optim.Optimizer) -> None:
    """``opt.step()``: the step's forward and backward ran before it (streamed), so no closure is passed. An
    optimizer that needs one (SAM, a line search: it evaluates the loss again inside its step) fails on its own
    terms; its error gets a note saying why and what to change."""
    try:
        opt.step()
    except (AssertionError, TypeError, ValueError, RuntimeError) as err:
        if "closure" in str(err).lower() or "'NoneType' object is not callable" in str(err):
            err.add_note(
                f"MegaTrainStrategy: {type(opt).__name__}.step() was called without a closure: the strategy runs the "
                "step's forward and backward, streaming the blocks, before the update, and cannot run them again "
                "inside it. An optimizer that re-evaluates the loss inside its step (SAM, line searches) is not "
                "supported: use one that steps once per backward (AdamW, SGD, ...), or Lightning's default strategy.")
        raise


@contextlib.contextmanager
def _without_pre_hooks(opt: torch.optim.Optimizer) -> Iterator[None]:
    """``opt.step()`` without its step pre-hooks (they ran before the closure). Sync point: the global ones are
    out of the registry meanwhile; no other thread steps a torch optimizer (the host worker runs kernels)."""
    own, held = opt._optimizer_step_pre_hooks, dict(_global_optimizer_pre_hooks)
    opt._optimizer_step_pre_hooks = OrderedDict()
    _global_optimizer_pre_hooks.clear()
    try:
        yield
    finally:
        opt._optimizer_step_pre_hooks = own
        _global_optimizer_pre_hooks.update(held)


def chain_zero_grad(owner: Any, callback: Callable[[bool], None]) -> None:
    """Wrap this instance's ``zero_grad`` (an optimizer's or a module's) so ``callback(set_to_none)`` runs first. A
    copy of ``owner`` (deepcopy, pickle) gets the ``zero_grad`` it had before: its own (``attached.py``)."""
    original = owner.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        callback(set_to_none)
        original(set_to_none=set_to_none)

    owner.zero_grad = method_of(owner, "zero_grad", zero_grad)
