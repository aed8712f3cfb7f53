"""Pooled gradient buffers: when nothing accumulates and each block's update overlaps the backward, the
host keeps no full-size fp32 gradient accumulator, only ``grad_buffers`` block-sized buffers lent in turn.

Training stays exact (parity with Lightning's default strategy, also with one buffer for six blocks, which
makes the device wait for the host optimizer), and the buffers really are lent and returned.
"""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest

from conftest import strategy_of, assert_parity, fit, megatrain
from megatrain_lightning import MegaTrainStrategy
from test_streaming import HooklessNet, _loader, _trainer
from zoo import ZOO

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class PoolProbe(L.Callback):
    """After each step: which stores own a gradient buffer, and how many buffers were lent so far."""

    def __init__(self) -> None:
        self.rows: list[tuple[list[bool], int, int]] = []
        self.block_grads_after_step: list[bool] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        engine = trainer.strategy.engine
        owns = [s.grad is not None for s in engine.stores]
        self.rows.append((owns, engine.stats.grads_lent, engine.grads.pool_made))
        self.block_grads_after_step = [p.grad is not None for s in engine.stores for p in s.params]


@pytest.mark.parametrize("buffers", [1, 4])
def test_parity_with_pooled_gradients(buffers: int) -> None:
    """One buffer for six blocks: the backward waits for each update before the next block's copy."""
    factory = partial(ZOO["llama"], optimizer="adamw", lr=3e-3, scheduler=True)
    ref = fit(factory, None, max_steps=6)
    probe = PoolProbe()
    got = fit(factory, megatrain(grad_buffers=buffers), max_steps=6, callbacks=[probe])
    assert_parity(ref, got)
    n_blocks = len(probe.rows[0][0])
    per_step = probe.rows[0][1]  # every block, and the resident store too when it is no larger than a block
    assert per_step >= n_blocks
    assert [row[1] for row in probe.rows] == [per_step * (i + 1) for i in range(6)]  # the pool really ran
    assert 1 <= probe.rows[-1][2] <= buffers  # made on demand, never more than the pool


def test_no_block_keeps_a_gradient_buffer_when_nothing_accumulates() -> None:
    depth = 5
    probe = PoolProbe()
    _trainer(strategy_of(grad_buffers=2), max_steps=3, callbacks=[probe]).fit(HooklessNet(depth=depth), _loader())
    # every block borrowed, every step, and both resident stores (input layer, output layer: smaller than a block)
    assert [row[1] for row in probe.rows] == [depth + 2, 2 * (depth + 2), 3 * (depth + 2)]
    for owns, _, made in probe.rows:
        assert owns == [False] * depth  # each buffer went back after its block's update
        assert 1 <= made <= 2  # made on demand, never more than the pool
    assert probe.block_grads_after_step and not any(probe.block_grads_after_step)  # released with their buffers


@pytest.mark.parametrize("kwargs", [dict(grad_buffers=0), dict(accumulate_grad_batches=2), dict(gradient_clip_val=1.0)],
                         ids=["no-pool", "accumulate", "clip"])
def test_blocks_keep_their_own_accumulator_otherwise(kwargs: dict) -> None:
    buffers = kwargs.pop("grad_buffers", 4)
    probe = PoolProbe()
    _trainer(strategy_of(grad_buffers=buffers), max_steps=2, callbacks=[probe], **kwargs).fit(HooklessNet(depth=3), _loader())
    assert all(row[1] == 0 for row in probe.rows)  # nothing lent
    assert probe.rows[-1][0] == [True] * 3
    assert all(probe.block_grads_after_step)


def test_negative_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="grad_buffers"):
        strategy_of(grad_buffers=-1)


def test_automatic_choice_takes_own_accumulators_when_they_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """grad_buffers=None (the default): own accumulators (faster when the host optimizer is the bottleneck)
    if they and the Adam moments fit in the host memory available, else a pool of 4."""
    from megatrain_lightning import host_memory
    from megatrain_lightning.config import AUTO_POOL, grad_buffers_for
    from megatrain_lightning.engine import StreamingEngine

    assert grad_buffers_for(None, 89, 100) == 0 and grad_buffers_for(None, 91, 100) == AUTO_POOL
    assert grad_buffers_for(3, 10**15, 100) == 3  # an explicit count wins
    chosen = {}
    total = host_memory.total_bytes()
    for fits, need in ((True, 0.5 * total), (False, 0.95 * total)):  # the footprint with own accumulators
        monkeypatch.setattr(StreamingEngine, "_host_need_with_own_accumulators", lambda self, need=need: need)
        probe = PoolProbe()
        _trainer(MegaTrainStrategy(), max_steps=1, callbacks=[probe]).fit(HooklessNet(depth=3), _loader())
        chosen[fits] = probe.rows[-1][1]  # buffers lent in the step
    assert chosen == {True: 0, False: 3 + 2}  # own accumulators; else every store borrowed
