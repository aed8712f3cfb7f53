"""The placement the strategy chooses from a measured step (``plan/measured.py``, ``auto_placement.py``) and the
engine's change of placement between steps (``StreamingEngine.place``).

On the CPU the device is the host, so nothing is measured or chosen there (``EngineConfig()`` trains on the
streaming placement, exactly as before); what is checked here is that a placement taken between any two
micro-batches (mid-window too, with deferred updates running on) trains exactly as Lightning's default
strategy, and the choice's arithmetic against the planner's models. The measurement and the back-off run on
the GPU: ``tests/test_auto_placement_cuda.py``.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import lightning.pytorch as pl
import pytest

from conftest import fit, megatrain, run_parity
from megatrain_lightning.config import STREAMING, EngineConfig
from megatrain_lightning.plan.measured import (
    Measured, after_out_of_memory, back_off, by_measurement, by_planner, clamp, matmuls_ratio,
)
from megatrain_lightning.plan.memory import GB
from zoo import ZOO

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

PLACEMENTS = [
    dict(slots=3, keep_activations=2, kept_saves="all", cache_weights=3, offload_inputs=False),
    dict(slots=2, keep_activations=99, kept_saves="matmuls", cache_weights=0, offload_inputs=True),
    dict(slots=2, keep_activations=1, kept_saves="all", cache_weights=0, offload_inputs=1),
    STREAMING,
]


class NewPlacements(pl.Callback):
    """After each given batch, the engine takes the next placement of PLACEMENTS (no-op on other strategies)."""

    megatrain_reads_weights = False  # it only moves device memory: deferred updates may run on

    def __init__(self, after: tuple[int, ...]) -> None:
        self.after, self.taken, self.batches = after, 0, 0

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        self.batches += 1
        if engine is not None and self.batches - 1 in self.after:
            engine.place(EngineConfig(**PLACEMENTS[self.taken % len(PLACEMENTS)]))
            self.taken += 1


@pytest.mark.parametrize("accumulate", [1, 2], ids=["each-step", "mid-window"])
def test_a_placement_taken_between_micro_batches_trains_exactly(accumulate: int) -> None:
    factory = partial(ZOO["llama"], optimizer="adamw", lr=3e-3, scheduler=True)
    callback = NewPlacements(after=(0, 1, 2, 4, 6))  # micro-batches, counted over the megatrain run
    run_parity(factory, megatrain(), max_steps=8 // accumulate, accumulate_grad_batches=accumulate,
               callbacks=[callback])
    assert callback.taken == 5  # every placement of PLACEMENTS was taken, the streaming one last


def test_on_the_cpu_nothing_is_measured_or_chosen() -> None:
    run = fit(partial(ZOO["llama"], optimizer="adamw", lr=3e-3), megatrain(), max_steps=2)
    strategy = run.trainer.strategy
    assert EngineConfig().unset == ("slots", "keep_activations", "kept_saves", "cache_weights", "offload_inputs")
    assert strategy.placement is None  # torn down, and never made on the CPU
    assert strategy.config == EngineConfig()


# ---------------------------------------------------------------------------------- the choice's arithmetic
def _qwen_3b():
    from test_placement import _setting

    return _setting("model=qwen2_5_3b", "data.batch_size=8", "hardware=h200_126g")


def _measured(shape, **kw) -> Measured:
    base = dict(peak=30 * GB, kept_graph=2.2 * GB, block_weights=0.16 * GB, budget=120 * GB, layers=shape.layers,
                matmuls_ratio=matmuls_ratio(shape))
    return Measured(**{**base, **kw})


def test_without_shapes_the_most_kept_blocks_then_the_most_cached_weights() -> None:
    m = Measured(peak=10 * GB, kept_graph=2 * GB, block_weights=1 * GB, budget=40 * GB, layers=36)
    e = by_measurement(m, EngineConfig())
    assert (e.keep_activations, e.cache_weights, e.slots, e.kept_saves) == (10, 10, 2, "all")  # 10 + 10 x 3 = 40
    assert m.fits(e) and not m.fits(dataclasses.replace(e, keep_activations=11, cache_weights=11))
    roomy = dataclasses.replace(m, kept_graph=0.5 * GB)
    e = by_measurement(roomy, EngineConfig())
    assert (e.keep_activations, e.cache_weights) == (20, 20)  # 10 + 20 x 1.5 = 40
    set_by_user = by_measurement(m, EngineConfig(keep_activations=4))
    assert set_by_user.keep_activations == 4 and set_by_user.cache_weights == 22  # 10 + 4 x 2 + 22 x 1 = 40
    nothing = by_measurement(dataclasses.replace(m, budget=9 * GB), EngineConfig())
    assert nothing == EngineConfig().filled()


def test_with_shapes_the_planners_choice_within_the_measured_budget() -> None:
    shape, work, hw = _qwen_3b()
    m = _measured(shape)
    chosen, step = by_planner(m, EngineConfig(), shape, work, hw)
    assert not chosen.unset and chosen.keep_activations > 0 and step > 0
    assert m.fits(chosen)
    tight = _measured(shape, budget=45 * GB)
    small, _ = by_planner(tight, EngineConfig(), shape, work, hw)
    assert tight.fits(small) and small.cached_blocks < chosen.cached_blocks
    # a user who set a field keeps it, however tight the budget
    fixed, _ = by_planner(tight, EngineConfig(keep_activations=30, kept_saves="all"), shape, work, hw)
    assert (fixed.keep_activations, fixed.kept_saves) == (30, "all")


def test_clamp_takes_slots_then_cached_weights_then_kept_blocks() -> None:
    m = Measured(peak=10 * GB, kept_graph=2 * GB, block_weights=1 * GB, budget=30 * GB, layers=36)
    e = EngineConfig(slots=3, keep_activations=5, kept_saves="all", cache_weights=12, offload_inputs=False)
    assert m.predicted_peak(e) == 10 * GB + 5 * 2 * GB + 13 * GB
    out = clamp(m, e, EngineConfig().unset)
    assert (out.slots, out.keep_activations, out.cache_weights) == (2, 5, 10)
    assert clamp(m, e, ()) == e  # nothing of it left open: nothing changed


def test_a_trial_above_the_budget_and_an_out_of_memory_back_off() -> None:
    m = Measured(peak=10 * GB, kept_graph=2 * GB, block_weights=1 * GB, budget=40 * GB, layers=36)
    e = by_measurement(m, EngineConfig())
    unset = EngineConfig().unset
    same_m, same = back_off(m, e, m.predicted_peak(e), unset)
    assert same == e and same_m == m  # the prediction held
    m2, smaller = back_off(m, e, m.predicted_peak(e) + 6 * GB, unset)
    assert m2.peak == 16 * GB and m2.predicted_peak(smaller) <= m.budget
    assert (smaller.keep_activations, smaller.cache_weights) == (8, 8)  # 16 + 8 x 3 = 40
    m3, after = after_out_of_memory(m, e, unset)
    assert m3.budget == 25 * GB and after.keep_activations == 5  # half of the 30 GB it added
    tiny = Measured(peak=10 * GB, kept_graph=2 * GB, block_weights=1 * GB, budget=13.5 * GB, layers=36)
    one = by_measurement(tiny, EngineConfig())
    assert one.keep_activations == 1
    _, last = after_out_of_memory(tiny, one, unset)
    assert last == EngineConfig().filled()  # down to the streaming placement
