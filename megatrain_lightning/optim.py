"""The optimizer plugin: the user's optimizer, stepped on the host master weights.

The optimizer that ``configure_optimizers`` returns stays the object the user and their LR schedulers
see: its ``param_groups`` hold the hyperparameters, its ``state`` the per-parameter state, its
``state_dict()`` the usual format (a checkpoint loads into a plain ``torch.optim.AdamW`` and back).

* Adam, AdamW and :class:`HostAdamW` (without ``amsgrad``) take the fast path: their moments live in the
  host store's flat buffers (``state[p]["exp_avg"]`` is a view of them) and each (block, param group)
  range is updated by one fused multi-threaded kernel call.
* Any other ``torch.optim`` optimizer runs its own ``step()``: the parameters it holds are the module's
  parameters, which are the fp32 host masters, and their ``.grad`` are views of the host accumulators.

With ``host_state="compact"`` stores only the fast path exists (other optimizers are refused). The
moments are bf16 (``state[p]["exp_avg"]`` and ``["exp_avg_sq"]`` are bf16 views, saved as such), and
``state[p]["master_low"]`` is an int16 view of the low half of the fp32 master, so that a checkpoint
resumes exactly: the model's ``state_dict()`` holds the bf16 high half. A plain ``torch.optim.AdamW``
loads such a state dict too (moments cast to its parameters' dtype, ``master_low`` unused).
"""

from __future__ import annotations

import time
from itertools import chain
from typing import Any, Callable, Collection, Iterable, Sequence

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from .engine.host_adam import (
    AdamHyper, CompactSpan, Piece, adam_kernel, compact_adam_step, fused_adam_step, fused_adam_step_half,
)
from .engine.host_store import FlatStore


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
    """Adam-family optimizers whose update the fused flat path reproduces."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return False
    return not any(
        g.get("amsgrad") or g.get("differentiable") or g.get("capturable") for g in optimizer.param_groups
    )


class _Range:
    """Cached views of one (store, param group) range: what one fused call updates."""

    def __init__(self, store: FlatStore, indices: list[int]) -> None:
        self.store = store
        self.indices = indices
        self.params = [store.params[i] for i in indices]
        self.ea_views: list[torch.Tensor] | None = None
        self.eas_views: list[torch.Tensor] | None = None
        # (params, grads, exp_avgs, exp_avg_sqs, steps) of a full step, reused while nothing changes
        self.cache: tuple[list[torch.Tensor], ...] | None = None
        # compact stores: (spans, steps) of a full step, reused likewise
        self.compact_cache: tuple[list[CompactSpan], list[torch.Tensor]] | None = None
        # the gradient buffer the caches were built on: a pooled buffer changes from step to step
        self.cache_grad: torch.Tensor | None = None

    def ensure_moment_views(self) -> None:
        """Per-parameter views of the store's Adam moments (allocating them on first use)."""
        if self.ea_views is None:
            ea, eas = self.store.moment_buffers()
            self.ea_views, self.eas_views = self.store.layout.views(ea), self.store.layout.views(eas)


class HostOptimizer:
    """Steps ``optimizer`` on the host store.

    Args:
        optimizer: the user's optimizer; its params must be parameters of the streamed model.
        stores: the engine's flat stores (blocks and resident part).
        on_zero_grad: told of every ``optimizer.zero_grad(set_to_none)``, so gradients the engine holds
            aside during a step are cleared too.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        stores: Sequence[FlatStore],
        on_zero_grad: Callable[[bool], None] | None = None,
    ) -> None:
        self.optimizer = optimizer
        if on_zero_grad is not None:
            chain_zero_grad(optimizer, on_zero_grad)
        where: dict[int, tuple[FlatStore, int]] = {}
        for store in stores:
            for i, p in enumerate(store.params):
                where[id(p)] = (store, i)
        missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in where]
        if missing:
            raise ValueError(
                f"{type(optimizer).__name__} holds {len(missing)} tensors that are not parameters of the "
                "LightningModule; MegaTrainStrategy keeps optimizer state for the module's parameters only. "
                "Build the optimizer from `self.parameters()` (or subsets of it) in configure_optimizers."
            )
        self.fast = is_fast_adam(optimizer)
        self.compact = any(s.compact for s in stores)
        if self.compact and not self.fast:
            raise ValueError(
                f"host_state='compact' keeps bf16 Adam moments and steps them with its own kernel, so it "
                f"supports torch.optim.Adam, torch.optim.AdamW and HostAdamW (without amsgrad) only, not "
                f"{type(optimizer).__name__}"
                f"{' with amsgrad (or differentiable/capturable)' if isinstance(optimizer, torch.optim.Adam) else ''}. "
                "Use MegaTrainStrategy(host_state='fp32') for other optimizers."
            )
        self.early_updates = 0  # stores updated as their gradients landed, over the run (for tests and logs)
        self.update_seconds = 0.0  # host time spent in those overlapped updates, over the run
        # ranges[g]: per store, the layout indices of the params of group g (contiguous by construction).
        self.ranges: list[list[_Range]] = []
        for group in optimizer.param_groups:
            per_store: dict[int, tuple[FlatStore, list[int]]] = {}
            for p in group["params"]:
                store, i = where[id(p)]
                per_store.setdefault(id(store), (store, []))[1].append(i)
            self.ranges.append([_Range(s, sorted(ix)) for s, ix in per_store.values()])
        if self.fast:
            self.adopt_state()
        if self.compact:
            # torch's load_state_dict casts every state tensor to its parameter's dtype (bf16), which
            # would round the int16 low halves: set them aside before, put them back after.
            self._held_low: dict[int, torch.Tensor] = {}
            optimizer.register_load_state_dict_pre_hook(self._hold_low_halves)
            optimizer.register_load_state_dict_post_hook(self._restore_low_halves)

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
                ea, eas = r.store.moment_buffers()
                ea_views = r.store.layout.views(ea)
                eas_views = r.store.layout.views(eas)
                low = r.store.master_low
                low_views = r.store.layout.views(low) if low is not None else None
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
                    st["step"] = (step if isinstance(step, torch.Tensor) else torch.tensor(float(step))).to(
                        device="cpu", dtype=torch.float32
                    )
                    st["exp_avg"] = ea_views[i]
                    st["exp_avg_sq"] = eas_views[i]
                r.cache = None  # the step tensors were replaced
                r.compact_cache = None

    def _hold_low_halves(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """load_state_dict pre-hook: take the int16 ``master_low`` tensors out before torch casts them."""
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

    # ------------------------------------------------------------------ step
    def step(self, skip: Collection[int] = ()) -> None:
        """One optimizer step on the host, with the optimizer's step hooks run around it as ``step()`` would.

        Stores whose ids are in ``skip`` were handed to an :meth:`overlap_update` of this step: they are
        updated already, or will be by the time the engine next uses them.
        """
        opt = self.optimizer
        if not self.fast:
            assert not skip
            opt.step()
            return
        for hook in chain(_global_optimizer_pre_hooks.values(), opt._optimizer_step_pre_hooks.values()):
            hook(opt, (), {})
        with torch.no_grad():
            for group, ranges in zip(opt.param_groups, self.ranges):
                hyper = self._hyper(group)
                for r in ranges:
                    if id(r.store) not in skip:
                        self._step_range(r, hyper)
        self.early_updates += len(skip)
        for hook in chain(opt._optimizer_step_post_hooks.values(), _global_optimizer_post_hooks.values()):
            hook(opt, (), {})
        if hasattr(opt.step, "_wrapped_by_lr_sched"):
            opt._opt_called = True  # what the LR scheduler's step wrapper records; it is bypassed here

    def can_overlap(self) -> bool:
        """Whether stores may be updated one by one as their gradients land (no pre-step hook to honour)."""
        opt = self.optimizer
        return self.fast and not _global_optimizer_pre_hooks and not opt._optimizer_step_pre_hooks

    def can_defer(self) -> bool:
        """Whether those updates may also run on after :meth:`step` returns: no post-step hook either
        (it must see every update done)."""
        opt = self.optimizer
        return self.can_overlap() and not _global_optimizer_post_hooks and not opt._optimizer_step_post_hooks

    def overlap_update(self) -> "StoreUpdate":
        """The update of one store, to run on the host worker as soon as its gradients are final.

        The hyperparameters are read now, at the start of the step: the update may run after the LR
        scheduler has already stepped (updates run on into the next forward). The caller passes the stores
        it ran this on to :meth:`step` as ``skip``.
        """
        return StoreUpdate(self, [self._hyper(g) for g in self.optimizer.param_groups])

    def _hyper(self, group: dict[str, Any]) -> AdamHyper:
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

    def _step_range(self, r: _Range, hyper: AdamHyper) -> None:
        if r.store.compact:
            self._step_range_compact(r, hyper)
            return
        store = r.store
        if store.half_grad is not None:
            self._step_range_half(r, hyper)
            return
        grad_views = store.grad_views if store.grad is not None else None
        # Steady state: every gradient is the store's own view and every state exists -> cached lists.
        if r.cache is not None and grad_views is not None and r.cache_grad is store.grad and all(
            p.grad is grad_views[i] for i, p in zip(r.indices, r.params)
        ):
            fused_adam_step(*r.cache, hyper)
            return
        state = self.optimizer.state
        r.ensure_moment_views()
        ps, gs, eas_l, eass_l, steps = [], [], [], [], []
        for i, p in zip(r.indices, r.params):
            if p.grad is None:
                continue  # as torch: a parameter without a gradient is not updated, not even decayed
            st = _ensure_state(state[p], r, i)
            ps.append(store.master_views[i])
            gs.append(p.grad)
            eas_l.append(r.ea_views[i])
            eass_l.append(r.eas_views[i])
            steps.append(st["step"])
        fused_adam_step(ps, gs, eas_l, eass_l, steps, hyper)
        complete = len(ps) == len(r.params) and grad_views is not None
        r.cache = (ps, gs, eas_l, eass_l, steps) if complete and all(
            g is grad_views[i] for g, i in zip(gs, r.indices)
        ) else None
        r.cache_grad = store.grad

    def _step_range_half(self, r: _Range, hyper: AdamHyper) -> None:
        """The update of one range from the store's bf16 gradients (``FlatStore.hold_half_grad``): every
        parameter of the store has one, none has a ``.grad``."""
        store = r.store
        assert store.half_grad is not None
        ea, eas = store.moment_buffers()
        r.ensure_moment_views()
        state = self.optimizer.state
        offsets = store.layout.offsets
        steps = [_ensure_state(state[p], r, i)["step"] for i, p in zip(r.indices, r.params)]
        torch._foreach_add_(steps, 1)
        pieces = [Piece(offsets[i], offsets[i] + p.numel(), step) for i, p, step in zip(r.indices, r.params, steps)]
        fused_adam_step_half(store.master, ea, eas, store.half_grad, pieces, hyper)

    def _step_range_compact(self, r: _Range, hyper: AdamHyper) -> None:
        """The compact-state update of one range: one span per run of adjacent parameters whose
        gradients are the store's own accumulator views and whose step counts agree."""
        store = r.store
        ea, eas = store.moment_buffers()
        if store.half_grad is not None:  # bf16 gradients, one for every parameter: spans of equal steps
            self._step_range_compact_half(r, hyper)
            return
        grad_views = store.grad_views if store.grad is not None else None
        if r.compact_cache is not None and grad_views is not None and r.cache_grad is store.grad and all(
            p.grad is grad_views[i] for i, p in zip(r.indices, r.params)
        ):
            spans, steps = r.compact_cache
            torch._foreach_add_(steps, 1)
            compact_adam_step(store.master, store.master_low, ea, eas, spans, hyper)
            return
        state = self.optimizer.state
        r.ensure_moment_views()
        low_views = store.layout.views(store.master_low) if store.master_low is not None else None
        offsets = store.layout.offsets
        # (first index, last index, own gradient?, step) per run; a foreign .grad is a run of its own
        runs: list[list[Any]] = []
        steps: list[torch.Tensor] = []
        for i, p in zip(r.indices, r.params):
            if p.grad is None:
                continue  # as torch: a parameter without a gradient is not updated, not even decayed
            st = _ensure_state(state[p], r, i, low_views)
            steps.append(st["step"])
            own = grad_views is not None and p.grad is grad_views[i]
            last = runs[-1] if runs else None
            if last is not None and own and last[2] and last[1] == i - 1 and float(last[3]) == float(st["step"]):
                last[1] = i
            else:
                runs.append([i, i, own, st["step"]])
        torch._foreach_add_(steps, 1)
        spans = []
        for first, last, own, step in runs:
            start, end = offsets[first], offsets[last] + r.store.params[last].numel()
            if own:
                assert store.grad is not None
                grad = store.grad[start:end]  # alignment padding in between: zeros, and stays zero
            else:
                grad = store.params[first].grad.detach().reshape(-1).to(torch.float32)
            spans.append(CompactSpan(start, end, grad, step))
        compact_adam_step(store.master, store.master_low, ea, eas, spans, hyper)
        complete = len(steps) == len(r.params) and all(run[2] for run in runs)
        r.compact_cache = (spans, steps) if complete else None
        r.cache_grad = store.grad

    def _step_range_compact_half(self, r: _Range, hyper: AdamHyper) -> None:
        store = r.store
        assert store.half_grad is not None
        ea, eas = store.moment_buffers()
        r.ensure_moment_views()
        low_views = store.layout.views(store.master_low) if store.master_low is not None else None
        state = self.optimizer.state
        offsets = store.layout.offsets
        steps = [_ensure_state(state[p], r, i, low_views)["step"] for i, p in zip(r.indices, r.params)]
        spans: list[CompactSpan] = []
        first = None
        for k, (i, p) in enumerate(zip(r.indices, r.params)):
            if first is None:
                first = k
            last = k == len(steps) - 1 or float(steps[k + 1]) != float(steps[first]) or r.indices[k + 1] != i + 1
            if last:
                start, end = offsets[r.indices[first]], offsets[i] + p.numel()
                spans.append(CompactSpan(start, end, store.half_grad[start:end], steps[first]))
                first = None
        # one increment per parameter; a span passes its first parameter's (equal) step to the kernel
        torch._foreach_add_(steps, 1)
        compact_adam_step(store.master, store.master_low, ea, eas, spans, hyper)


class StoreUpdate:
    """One step's overlapped update of a store (``update(store)``), or of a flat range of an fp32 store
    at a time (``update.range(store, lo, hi)``), with the hyperparameters read at the start of the step.

    Ranges let a large store's update be pipelined with its copies (the engine's resident part: gradients
    come in and weights go out range by range while the next range is updated). Called for consecutive
    ranges covering the store, with ``lo`` and ``hi`` multiples of 16, they give bit for bit the update
    of the whole store: the kernel is elementwise and every piece of a parameter starts a multiple of 16
    elements from its start (``host_adam.fused_adam_step_half`` says why that matters).
    """

    def __init__(self, host: HostOptimizer, hypers: list[AdamHyper]) -> None:
        self.host = host
        self.hypers = hypers

    def __call__(self, store: FlatStore) -> None:  # host worker thread
        t0 = time.perf_counter()
        with torch.no_grad():
            for hyper, ranges in zip(self.hypers, self.host.ranges):
                for r in ranges:
                    if r.store is store:
                        self.host._step_range(r, hyper)
        self.host.update_seconds += time.perf_counter() - t0

    def can_range(self, store: FlatStore) -> bool:
        """Whether :meth:`range` applies: fp32 stores with fp32 gradients (not compact, not bf16)."""
        return not store.compact

    def range(self, store: FlatStore, lo: int, hi: int) -> None:  # host worker thread
        """Update the elements ``[lo, hi)`` of ``store``: each parameter's step count goes up with the
        range that holds its first element; a parameter without ``.grad`` is not updated (as torch)."""
        t0 = time.perf_counter()
        host = self.host
        state = host.optimizer.state
        offsets = store.layout.offsets
        with torch.no_grad():
            ea, eas = store.moment_buffers()
            for hyper, ranges in zip(self.hypers, host.ranges):
                for r in ranges:
                    if r.store is not store:
                        continue
                    r.ensure_moment_views()
                    ps, gs, ms, vs, steps, fresh = [], [], [], [], [], []
                    for i, p in zip(r.indices, r.params):
                        start = offsets[i]
                        a, b = max(start, lo), min(start + p.numel(), hi)
                        if a >= b or p.grad is None:
                            continue
                        st = _ensure_state(state[p], r, i)
                        if a == start:
                            fresh.append(st["step"])
                        ps.append(store.master[a:b])
                        gs.append(p.grad.detach().reshape(-1)[a - start : b - start])
                        ms.append(ea[a:b])
                        vs.append(eas[a:b])
                        steps.append(st["step"])
                    if fresh:
                        torch._foreach_add_(fresh, 1)
                    if ps:
                        adam_kernel(ps, gs, ms, vs, steps, hyper)
        host.update_seconds += time.perf_counter() - t0


    # -------------------------------------------------------------- an embedding's update split by rows
    def _only_range(self, store: FlatStore) -> tuple[_Range, AdamHyper]:
        found = [(r, h) for h, ranges in zip(self.hypers, self.host.ranges) for r in ranges if r.store is store]
        assert len(found) == 1 and len(found[0][0].indices) == 1, "a store of one parameter in one param group"
        return found[0]

    def can_split_rows(self, store: FlatStore) -> bool:
        """Whether :meth:`rows_first` / :meth:`rows_last` apply: the store's one parameter is stepped by
        this optimizer, in one param group, on the fp32 fast path."""
        found = [r for ranges in self.host.ranges for r in ranges if r.store is store]
        return self.host.fast and not store.compact and len(found) == 1 and len(found[0].indices) == 1

    def rows_first(self, store: FlatStore, touched: torch.Tensor, zero_chunk: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """First half of the update of a store holding one embedding table ``[V, H]`` whose gradient is zero
        outside the rows ``touched`` (ascending): every row updated with a zero gradient, after the
        touched rows' weights and moments were set aside (returned, for :meth:`rows_last`). The step count
        goes up here. Bit for bit what the whole update gives the untouched rows: the kernel is elementwise
        and each piece starts a multiple of 16 elements from the table's start (``len(zero_chunk)`` is a
        multiple of 16), so every element takes the same vectorised or tail path."""
        t0 = time.perf_counter()
        r, hyper = self._only_range(store)
        p = r.params[0]
        with torch.no_grad():
            r.ensure_moment_views()
            assert r.ea_views is not None and r.eas_views is not None
            st = _ensure_state(self.host.optimizer.state[p], r, 0)
            w, m, v = store.master_views[0], r.ea_views[0], r.eas_views[0]
            saved = (w.index_select(0, touched), m.index_select(0, touched), v.index_select(0, touched))
            torch._foreach_add_([st["step"]], 1)
            n, c = p.numel(), zero_chunk.numel()
            wf, mf, vf = w.view(-1), m.view(-1), v.view(-1)
            bounds = [(a, min(a + c, n)) for a in range(0, n, c)]
            adam_kernel([wf[a:b] for a, b in bounds], [zero_chunk[: b - a] for a, b in bounds],
                        [mf[a:b] for a, b in bounds], [vf[a:b] for a, b in bounds], [st["step"]] * len(bounds), hyper)
        self.host.update_seconds += time.perf_counter() - t0
        return saved

    def rows_last(self, store: FlatStore, touched: torch.Tensor, grads: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> None:
        """Second half: the touched rows, from their set-aside state and their gradients ``[k, H]`` (the step
        count is not raised again), written back over what the first half gave them."""
        t0 = time.perf_counter()
        r, hyper = self._only_range(store)
        st = self.host.optimizer.state[r.params[0]]
        w_t, m_t, v_t = saved
        with torch.no_grad():
            adam_kernel([w_t], [grads], [m_t], [v_t], [st["step"]], hyper)
            assert r.ea_views is not None and r.eas_views is not None
            store.master_views[0].index_copy_(0, touched, w_t)
            r.ea_views[0].index_copy_(0, touched, m_t)
            r.eas_views[0].index_copy_(0, touched, v_t)
        self.host.update_seconds += time.perf_counter() - t0


def _ensure_state(st: dict[str, Any], r: _Range, i: int, low_views: list[torch.Tensor] | None = None) -> dict[str, Any]:
    """A parameter's Adam state on its first step: views of the store's moments (and low half)."""
    if not st:
        assert r.ea_views is not None and r.eas_views is not None
        st["step"] = torch.tensor(0.0)
        st["exp_avg"] = r.ea_views[i]
        st["exp_avg_sq"] = r.eas_views[i]
        if low_views is not None:
            st["master_low"] = low_views[i]
    return st


def chain_zero_grad(owner: Any, callback: Callable[[bool], None]) -> None:
    """Wrap this instance's ``zero_grad`` (an optimizer's or a module's) so ``callback(set_to_none)`` runs first."""
    original = owner.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        callback(set_to_none)
        original(set_to_none=set_to_none)

    owner.zero_grad = zero_grad
