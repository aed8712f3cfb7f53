"""MegaTrainPrecision: the dtype policy and the step sequence of a streamed model.

``"32-true"``: fp32 everywhere (exact parity with Lightning's default strategy).
``"bf16-mixed"``: block weights travel and compute in bf16 under autocast; masters, gradients and
optimizer state stay fp32 on the host; resident parameters run as fp32 device copies under autocast.

Unlike Lightning's precision plugins it does not call ``optimizer.step(closure)``: it runs the closure
(forward + backward), brings every gradient home, runs the user's hooks and clipping on the host
gradients, and steps the optimizer on the host store.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Generator, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

from .engine import StreamingEngine
from .interrupts import DeferredInterrupt
from .optim import HostOptimizer
from .optim.host_optimizer import step_without_closure

log = logging.getLogger(__name__)

_PRECISION = Literal["32-true", "bf16-mixed"]


class MegaTrainPrecision(Precision):
    """Precision plugin of :class:`~megatrain_lightning.MegaTrainStrategy`.

    Args:
        precision: ``"32-true"`` or ``"bf16-mixed"``. bf16 halves the weight bytes on the device and runs
            the matmuls on tensor cores; host state is fp32 in both.
        device_type: ``"cuda"`` or ``"cpu"``: where autocast applies.
    """

    def __init__(self, precision: _PRECISION = "32-true", device_type: str = "cuda") -> None:
        if precision not in ("32-true", "bf16-mixed"):
            why = {"16": "fp16 would need a loss scaler across host and device; use bf16-mixed",
                   "bf": "bf16-true would keep bf16 masters; use bf16-mixed (fp32 masters on the host, bf16 on the "
                         "device) or EngineConfig(host_state='compact') for bf16 host state",
                   "64": "fp64 weights are not streamed; use 32-true"}.get(str(precision)[:2], "use 32-true or bf16-mixed")
            raise ValueError(f"MegaTrainStrategy supports precision='32-true' or 'bf16-mixed', got {precision!r}: {why}.")
        self.precision = precision
        self.device_type = device_type
        self.engine: StreamingEngine | None = None
        self.host_optimizers: dict[int, HostOptimizer] = {}
        # Set by the strategy per training step: the host optimizer whose updates run store by store during
        # this micro-batch's backward (None: after it), and whether they may run on into the next forward.
        self.overlap: HostOptimizer | None = None
        self.defer_updates = False
        # Set by the strategy: skip steps with a non-finite loss (or gradients), stop after this many in a row
        self.skip_nonfinite = 0
        # Set by the strategy while it chooses an open placement (auto_placement.AutoPlacement): a step
        # trying one may run out of device memory and run again on a smaller one.
        self.placement: Any = None
        self.skipped_steps = 0  # over the run
        self.steps_run = 0  # optimizer steps that returned, over the run (a training step may be run again before one)
        self._consecutive = 0
        self._skip_window = False  # a micro-batch of the current accumulation window had a non-finite loss
        self.interrupts = DeferredInterrupt()
        self.on_abort: Callable[[BaseException], None] | None = None  # the strategy's: consistent state after an exception

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16-mixed" else torch.float32

    def attach(self, engine: StreamingEngine | None, host_optimizers: dict[int, HostOptimizer]) -> None:
        """Connect the engine and the host optimizers (keyed by ``id`` of the user's optimizer)."""
        self.engine = engine
        self.host_optimizers = host_optimizers

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module  # deliberate no-op: masters stay fp32 on the host; the slots hold the compute dtype

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision == "bf16-mixed":
            with torch.autocast(self.device_type, dtype=torch.bfloat16):
                yield
        else:
            yield

    @override
    def backward(  # type: ignore[override]
        self,
        tensor: torch.Tensor,
        model: "pl.LightningModule",
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if self.skip_nonfinite and self.engine is not None and not self._finite_everywhere(tensor):
            # host sync point (one scalar, before any update can start): this step will be skipped
            self._skip_window = True
            self.engine.finish_backward()  # no backward: the micro-batch ends without gradients
            return
        if self.engine is not None and self.overlap is not None:
            # The hyperparameters are read here, after training_step, zero_grad and on_before_backward (any of
            # which may set lr, betas or weight_decay: a warm-up by hand), as the default strategy's
            # optimizer.step would see them; no hook that may set them runs later (the strategy's _overlap_target).
            self.engine.on_grads_final = self.overlap.overlap_update()
        self.overlap = None
        self.interrupts.arm()  # a micro-batch's backward outside the optimizer step (accumulation) holds Ctrl-C too
        try:
            model.backward(tensor, *args, **kwargs)
            if self.engine is not None:
                # Host sync point: all gradients are in host memory before on_after_backward sees them.
                self.engine.finish_backward()
        except BaseException as exc:
            self.interrupts.drop()
            if self.on_abort is not None:
                self.on_abort(exc)
            raise
        finally:
            self.interrupts.release()

    def _finite_everywhere(self, loss: torch.Tensor) -> bool:
        """Whether the loss is finite, on every rank under data parallel (a host sync: one scalar)."""
        finite = bool(torch.isfinite(loss.detach()).all())
        assert self.engine is not None
        replicas = self.engine.replicas
        return replicas.all_true(finite, loss.device) if replicas.parallel else finite

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: float | int) -> None:
        if self.engine is not None and self.engine.replicas.parallel:
            from .data_parallel import clip_grad_norm

            clip_grad_norm(self.engine, list(self.main_params(optimizer)), float(clip_val))
            return
        super().clip_grad_by_norm(optimizer, clip_val)

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: "pl.LightningModule",
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if kwargs:
            raise TypeError(f"MegaTrainStrategy steps the optimizer on the host without arguments, got {sorted(kwargs)}")
        self.interrupts.arm()  # a Ctrl-C from here to the step's end waits for it (interrupts.py)
        try:
            closure_result = self._step(optimizer, model, closure)
        except BaseException as exc:
            self.interrupts.release()
            self.interrupts.drop()
            if self.on_abort is not None:
                self.on_abort(exc)
            raise
        self.interrupts.release()  # a held Ctrl-C is raised once Lightning has counted the step
        self.steps_run += 1
        return closure_result

    def _step(self, optimizer: Any, model: "pl.LightningModule", closure: Callable[[], Any]) -> Any:
        host = self.host_optimizers.get(id(optimizer))
        if host is not None:
            host.pre_step_hooks()  # before the closure, as the default strategy's optimizer.step(closure) runs them
        while True:
            try:
                closure_result = closure()
                break
            except torch.OutOfMemoryError:
                if self.placement is None or not self.placement.can_back_off:
                    raise
            # A step trying a placement ran out of memory in its backward, before any update (a tried step
            # does not overlap them; the engine has aborted it). Outside the except, once the failed
            # attempt's tensors are gone: a smaller placement, and the whole step (closure) again.
            self.placement.out_of_memory()
        claimed: set[int] = set()
        if self.engine is not None:
            self.engine.settle(wait=not self.defer_updates)
            claimed = self.engine.take_claimed()
        if self.skip_nonfinite and self.engine is not None:
            finite = self.engine.gradients_finite()  # host sync: one scalar
            if self.engine.replicas.parallel:
                finite = self.engine.replicas.all_true(finite, self.engine.device)
            if self._skip_window or not finite:
                if claimed:  # an early update ran (its own gradients were checked, and were finite)
                    raise FloatingPointError(
                        "non-finite gradients although the loss was finite, after some of the step's host updates "
                        "had run: the step cannot be skipped whole. Turn off the overlap for such runs "
                        "(EngineConfig(overlap_optimizer=False)) or find the operation that makes them.")
                self._skip(model, "loss" if self._skip_window else "gradients")
                return closure_result
            self._consecutive = 0
        self._after_closure(model, optimizer)  # on_before_optimizer_step, configure_gradient_clipping
        if self.engine is not None:
            self.engine.host_step_begins(claimed)  # a store updated on the device before comes home first
        if host is None:
            step_without_closure(optimizer)
        else:
            # the claimed stores were (or are being) updated on the host worker; under data parallel, the
            # stores another rank of the node owns are updated by that rank
            host.step(skip=claimed | (self.engine.not_owned() if self.engine is not None else set()))
        if self.engine is not None:
            self.engine.step_done(claimed)
            self.engine.weights_changed()
        return closure_result

    def _skip(self, model: "pl.LightningModule", what: str) -> None:
        """A step with a non-finite loss or gradients: no update (masters, moments and step counts as they
        were), counted and logged; after ``skip_nonfinite`` in a row, training stops."""
        self._skip_window = False
        self.skipped_steps += 1
        self._consecutive += 1
        step = model.trainer.global_step if model._trainer is not None else -1
        log.warning("MegaTrainStrategy: step %d skipped, its %s is not finite (%d in a row, %d in all)",
                    step, what, self._consecutive, self.skipped_steps)
        if self._consecutive >= self.skip_nonfinite:
            raise FloatingPointError(
                f"MegaTrainStrategy: {self._consecutive} steps in a row had a non-finite {what} "
                f"(skip_nonfinite={self.skip_nonfinite}): stopping. The weights and optimizer state are those "
                "before the first of them; lower the learning rate or look for the batch that overflows.")
