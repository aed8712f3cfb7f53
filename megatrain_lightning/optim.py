"""The optimizer plugin: the user's optimizer, stepped on the host master weights.

The optimizer that ``configure_optimizers`` returns stays the object the user and their LR schedulers
see: its ``param_groups`` hold the hyperparameters, its ``state`` the per-parameter state, its
``state_dict()`` the usual format (a checkpoint loads into a plain ``torch.optim.AdamW`` and back).

* Adam, AdamW and :class:`HostAdamW` (without ``amsgrad``) take the fast path: their moments live in the
  host store's flat buffers (``state[p]["exp_avg"]`` is a view of them) and each (block, param group)
  range is updated by one fused multi-threaded kernel call.
* Any other ``torch.optim`` optimizer runs its own ``step()``: the parameters it holds are the module's
  parameters, which are the fp32 host masters, and their ``.grad`` are views of the host accumulators.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from .engine.host_adam import AdamHyper, fused_adam_step
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
        self._stepped: set[int] = set()  # ids of stores updated early in this step
        self.early_updates = 0  # stores updated during a backward, over the run (for tests and logs)
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

    # ------------------------------------------------------------------ state
    def adopt_state(self) -> None:
        """Move any existing Adam state into the flat buffers and make ``state[p]`` views of them.

        Called at setup and after ``load_state_dict`` (which builds fresh tensors).
        """
        if not self.fast:
            return
        state = self.optimizer.state
        for ranges in self.ranges:
            for r in ranges:
                ea, eas = r.store.moment_buffers()
                ea_views = r.store.layout.views(ea)
                eas_views = r.store.layout.views(eas)
                for i, p in zip(r.indices, r.params):
                    st = state.get(p)
                    if not st:
                        continue
                    with torch.no_grad():
                        ea_views[i].copy_(st["exp_avg"])
                        eas_views[i].copy_(st["exp_avg_sq"])
                    step = st["step"]
                    st["step"] = (step if isinstance(step, torch.Tensor) else torch.tensor(float(step))).to(
                        device="cpu", dtype=torch.float32
                    )
                    st["exp_avg"] = ea_views[i]
                    st["exp_avg_sq"] = eas_views[i]
                r.cache = None  # the step tensors were replaced

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        """One optimizer step on the host, with the optimizer's step hooks run around it as ``step()`` would.

        Stores already updated by :meth:`step_store` during this step's backward are skipped.
        """
        opt = self.optimizer
        if not self.fast:
            opt.step()
            return
        for hook in chain(_global_optimizer_pre_hooks.values(), opt._optimizer_step_pre_hooks.values()):
            hook(opt, (), {})
        with torch.no_grad():
            for group, ranges in zip(opt.param_groups, self.ranges):
                hyper = self._hyper(group)
                for r in ranges:
                    if id(r.store) not in self._stepped:
                        self._step_range(r, hyper)
        self._stepped.clear()
        for hook in chain(opt._optimizer_step_post_hooks.values(), _global_optimizer_post_hooks.values()):
            hook(opt, (), {})
        if hasattr(opt.step, "_wrapped_by_lr_sched"):
            opt._opt_called = True  # what the LR scheduler's step wrapper records; it is bypassed here

    def can_overlap(self) -> bool:
        """Whether stores may be updated one by one as their gradients land (no pre-step hook to honour)."""
        opt = self.optimizer
        return self.fast and not _global_optimizer_pre_hooks and not opt._optimizer_step_pre_hooks

    def step_store(self, store: FlatStore) -> None:
        """Update one store's parameters now (host worker thread, during the backward); :meth:`step` skips it."""
        with torch.no_grad():
            for group, ranges in zip(self.optimizer.param_groups, self.ranges):
                hyper = self._hyper(group)
                for r in ranges:
                    if r.store is store:
                        self._step_range(r, hyper)
        self._stepped.add(id(store))
        self.early_updates += 1

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
        store = r.store
        grad_views = store.grad_views if store.grad is not None else None
        # Steady state: every gradient is the store's own view and every state exists -> cached lists.
        if r.cache is not None and grad_views is not None and all(
            p.grad is grad_views[i] for i, p in zip(r.indices, r.params)
        ):
            fused_adam_step(*r.cache, hyper)
            return
        state = self.optimizer.state
        ea, eas = store.moment_buffers()
        if r.ea_views is None:
            r.ea_views, r.eas_views = store.layout.views(ea), store.layout.views(eas)
        ps, gs, eas_l, eass_l, steps = [], [], [], [], []
        for i, p in zip(r.indices, r.params):
            if p.grad is None:
                continue  # as torch: a parameter without a gradient is not updated, not even decayed
            st = state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = r.ea_views[i]
                st["exp_avg_sq"] = r.eas_views[i]
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


def chain_zero_grad(owner: Any, callback: Callable[[bool], None]) -> None:
    """Wrap this instance's ``zero_grad`` (an optimizer's or a module's) so ``callback(set_to_none)`` runs first."""
    original = owner.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        callback(set_to_none)
        original(set_to_none=set_to_none)

    owner.zero_grad = zero_grad
