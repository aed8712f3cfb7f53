"""A placement left open, on a CUDA device: measure the first micro-batch, choose, try the choice, back off.

One phase per micro-batch; between two of them the engine is settled, and a new placement is taken there
(``StreamingEngine.place``; every placement gives the same result bit for bit):

* ``measure``: the first micro-batch streams (nothing kept or cached) and the engine measures it.
* ``try``: the next one runs the placement chosen from that measurement (``plan/measured.py``) and is measured
  too. It runs without the overlapped optimizer (no update starts before its backward has ended), so that a
  step that runs out of device memory can run again, whole, on a smaller placement: the caller hands the
  error to :meth:`AutoPlacement.out_of_memory` and repeats the step. A peak above the budget backs off the
  same way before the next micro-batch.
* ``done``: a tried placement that fit; it stays for the run.

Each change is one log line: the placement, why, and (with the model's shapes) the predicted step time; a mixture of
experts the chosen placement leaves bound by host work gets the planner's warning once after it (``warn``).
Lightning-free: the strategy calls :meth:`before_micro_batch` before each training micro-batch.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any, Callable

import torch
from torch import nn

from .config import PLACEMENT_FIELDS, EngineConfig
from .engine.compiled import COMPILED_MATMULS_RATIO
from .engine.device_update import device_moment_bytes
from .plan.measured import Measured, after_out_of_memory, back_off, by_measurement, by_planner, matmuls_ratio, moe_warning
from .plan.memory import GB
from .plan.placement import HEADROOM
from .plan.run import Workload
from .plan.shape import PlanShape

log = logging.getLogger(__name__)


def plan_shape(module: nn.Module) -> PlanShape | None:
    """The planner's shapes of the outermost Hugging Face model inside ``module`` (None without one)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    model = next((m for m in module.modules() if isinstance(m, PreTrainedModel)), None)
    if model is None:
        return None
    try:
        shape = PlanShape.of(model)
    except Exception as err:  # a config the planner does not read: measured placement without shapes
        log.debug("no planner shapes for %s: %s", type(model).__name__, err)
        return None
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return dataclasses.replace(shape, trainable_params=trainable) if trainable < shape.total_params else shape


class AutoPlacement:
    """Chooses the ``requested`` config's unset placement fields for ``engine`` from measured micro-batches.

    Args:
        engine: a :class:`~megatrain_lightning.engine.StreamingEngine` on a CUDA device, on the streaming
            placement.
        requested: the config the user gave (its None placement fields are the ones chosen).
        shape: the planner's shapes of the model (:func:`plan_shape`), or None.
        accumulate, clip: the step around the micro-batch (for the planner's timing).
        loss_chunk_tokens, mlp_chunk_tokens: the module's chunking (``models.CausalLM``), for the planner.
        hardware: returns the machine's profile (``hardware.detect``), called once when choosing.
        say: where each decision's one line goes (the strategy: Lightning's rank-zero info log).
        warn: where a warning goes (a mixture of experts bound by host work on the placement chosen; the
            strategy: its ``host_bound_warning``).
        model: the module's name, in that warning.
    """

    def __init__(self, engine: Any, requested: EngineConfig, shape: PlanShape | None, accumulate: int, clip: bool,
                 hardware: Callable[[], Any], loss_chunk_tokens: int | None = None,
                 mlp_chunk_tokens: int | None = None, say: Callable[[str], None] = log.info,
                 warn: Callable[[str], None] = log.warning, model: str = "The model") -> None:
        self.engine = engine
        self.say, self.warn, self.model = say, warn, model
        self.lines: list[str] = []  # every line said, in order (also in summary())
        self.chunks = dict(loss_chunk_tokens=loss_chunk_tokens, mlp_chunk_tokens=mlp_chunk_tokens)
        self.unset = requested.chosen_with_placement  # the placement fields left open, and update_on_device
        self.requested = requested
        self.shape = shape
        self.accumulate, self.clip = accumulate, clip
        self.hardware = hardware
        self.phase = "measure"
        self.measured: Measured | None = None
        self.predicted: float | None = None  # the planner's step time for the placement chosen (with shapes)
        self.backed_off = 0
        engine.meter.measure_next()

    def summary(self) -> dict[str, Any]:
        """The placement in use and how it was reached, for a run's metrics."""
        return {**{f: getattr(self.engine.config, f) for f in self.unset}, "phase": self.phase,
                "predicted_step_s": None if self.predicted is None else round(self.predicted, 4),
                "backed_off": self.backed_off, "log": list(self.lines)}

    @property
    def trying(self) -> bool:
        """Whether the micro-batch about to run (or running) tries a placement: no overlapped updates."""
        return self.phase == "try"

    def before_micro_batch(self) -> None:
        step = self.engine.meter.measured
        if step is None or self.phase == "done":
            return
        self.engine.meter.measured = None
        if self.phase == "measure":
            self._choose(step)
        else:
            self._check(step)

    @property
    def can_back_off(self) -> bool:
        """Whether a micro-batch that ran out of device memory now may run again on a smaller placement: it
        was trying one (nothing of its step updated), and that was more than the streaming placement."""
        return self.phase == "try" and self.measured is not None and self._chosen()

    def out_of_memory(self) -> None:
        """The micro-batch trying a placement ran out of device memory (its step aborted, nothing of it
        updated; :attr:`can_back_off` was True): a smaller placement is taken, for the caller to run the
        step again."""
        assert self.can_back_off and self.measured is not None
        held = float(self.engine.meter.memory.reserved())  # what the device gave this process: it ran out there
        gc.collect()  # the failed attempt's frames and tracebacks form cycles: free their device tensors now
        self.measured, smaller = after_out_of_memory(self.measured, self.engine.config, self.unset, held)
        self.backed_off += 1
        self.predicted = None
        self._take(smaller, "backed off (the step on the chosen placement ran out of device memory; it runs again)")

    # ------------------------------------------------------------------
    def _say(self, line: str) -> None:
        self.lines.append(line)
        self.say(line)

    def _chosen(self) -> bool:
        """Whether the engine runs anything beyond the streaming placement in the fields chosen here."""
        streaming = dataclasses.replace(self.engine.config, **{f: None for f in self.unset}).filled()
        return any(getattr(self.engine.config, f) != getattr(streaming, f) for f in self.unset)

    def _choose(self, step: Any) -> None:
        engine = self.engine
        weights = max(s.numel for s in engine.stores) * engine.compute_dtype.itemsize
        m = Measured(peak=float(step.peak), kept_graph=float(step.kept_graph), block_weights=float(weights),
                     budget=HEADROOM * engine.meter.usable_bytes, layers=len(engine.blocks), device_moments=self._moments(1),
                     device_block_moments=self._moments(2) - self._moments(1),
                     matmuls_ratio=None if self.shape is None else
                     COMPILED_MATMULS_RATIO if engine.compiled.whole
                     else matmuls_ratio(self.shape))
        self.measured = m
        predicted = None
        if self.shape is not None and step.tokens:
            work = Workload(micro_batch=step.batch, seq_len=step.seq, accumulate=self.accumulate,
                            bf16=engine.compute_dtype == torch.bfloat16, clip=self.clip, **self.chunks)
            hw = self.hardware()
            chosen, predicted = by_planner(m, self.requested, self.shape, work, hw)
        else:
            chosen = by_measurement(m, self.requested)
        why = (f"chosen from the first step (streaming: peak {step.peak / GB:.1f} GB, a kept block's activations "
               f"{step.kept_graph / GB:.2f} GB at {step.tokens} tokens; budget {m.budget / GB:.1f} GB)")
        self.predicted = predicted
        self._take(chosen, why, predicted)
        if predicted is not None:
            self._warn_if_host_bound(m, chosen, work, hw)

    def _warn_if_host_bound(self, m: Measured, chosen: EngineConfig, work: Workload, hw: Any) -> None:
        """A mixture of experts bound by host work on ``chosen``: the planner's warning, once (advice only: a
        failure to work it out is logged, never raised into the fit)."""
        assert self.shape is not None
        try:
            warning = moe_warning(m, self.requested, chosen, self.shape, work, hw, model=self.model)
        except Exception as err:  # noqa: BLE001 (the fit goes on without the advice)
            log.debug("no host-bound warning for %s: %s", self.model, err)
            return
        if warning:
            self.lines.append(f"warning: {warning}")
            self.warn(warning)

    def _moments(self, blocks: int) -> float:
        """The device bytes the updates on the device will take from the first overlapped step on with ``blocks``
        blocks updated there (the measured and tried steps do not overlap theirs): what a placement that turns
        them on must leave free (``Measured`` counts the first block's and each further one's)."""
        return 0.0 if self.accumulate > 1 or self.clip else float(device_moment_bytes(self.engine, blocks))

    def _check(self, step: Any) -> None:
        assert self.measured is not None
        # Once a step ran out, the device is known to be tight: the segments the allocator reserved count too
        # (a placement whose tensors fit with a little to spare can still run out through fragmentation).
        reserved = self.measured.capacity > 0
        peak = max(step.peak, step.reserved) if reserved else step.peak
        if peak <= self.measured.budget:
            self.phase = "done"
            self._say(f"placement tried: {'reserved' if reserved else 'peak'} {peak / GB:.1f} GB of the "
                      f"{self.measured.budget / GB:.1f} GB budget; it stays")
            return
        self.measured, smaller = back_off(self.measured, self.engine.config, float(peak), self.unset)
        self.backed_off += 1
        self.predicted = None
        self._take(smaller, f"backed off (the step on the chosen placement {'reserved' if reserved else 'peaked at'} "
                            f"{peak / GB:.1f} GB, above the {self.measured.budget / GB:.1f} GB budget)")

    def _take(self, chosen: EngineConfig, why: str, predicted: float | None = None) -> None:
        engine = self.engine
        fields = (*PLACEMENT_FIELDS, "update_on_device")
        current = {f: getattr(engine.config, f) for f in fields}
        values = ", ".join(f"{f}={getattr(chosen, f)}" for f in self.unset)
        timing = f"; predicted step {predicted:.3f} s" if predicted is not None else ""
        self._say(f"placement {why}: {values}{timing} (set any of them in EngineConfig to choose it yourself)")
        if {f: getattr(chosen, f) for f in fields} == current:
            self.phase = "done"  # the streaming placement again: the measured step ran on it
            return
        engine.place(chosen)
        engine.meter.measure_next()
        self.phase = "try"
