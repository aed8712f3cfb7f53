"""The resident part's update, range by range (``pipeline.RangedUpdate``).

The part the next forward needs first (input embedding, a tied head) is updated between one step's
backward and the next forward. Its gradients come home, it is updated and its weights go back range by
range, each range's copy to the device issued as soon as that range is updated. The ranges must give
exactly the update of the whole part: the same training run bit for bit, with parameters cut across
ranges and two param groups, and parity with Lightning's default strategy.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from conftest import assert_parity, fit, megatrain
from megatrain_lightning.engine import pipeline
from megatrain_lightning.optim import StoreUpdate
from zoo import ZOO


class Probe(pl.Callback):
    megatrain_reads_weights = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.ranged_copies = trainer.strategy.engine.ranged_copies
        self.resident_numel = trainer.strategy.engine.resident_store.numel


@pytest.mark.parametrize("model", ["qwen2", "llama"])  # tied embeddings (one resident part), untied (two)
def test_resident_update_by_ranges_is_exact(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    factory = partial(ZOO[model], optimizer="adamw", param_groups=True, scheduler=True)
    ref = fit(factory, None, max_steps=5)
    whole_probe, cut_probe = Probe(), Probe()
    monkeypatch.setattr(pipeline, "RANGE_ELEMS", 1 << 40)  # one range
    whole = fit(factory, megatrain(grad_buffers=0), max_steps=5, callbacks=[whole_probe])
    monkeypatch.setattr(pipeline, "RANGE_ELEMS", 80)  # 80 elements: parameters cut across ranges
    cut = fit(factory, megatrain(grad_buffers=0), max_steps=5, callbacks=[cut_probe])
    n_ranges = -(-cut_probe.resident_numel // 80)
    assert n_ranges > 10
    # the first step's update (no Adam state yet) and every later one, copied range by range (4 steps
    # reach a next forward; the last step's update is copied by nothing)
    assert cut_probe.ranged_copies == 4 * n_ranges, (cut_probe.ranged_copies, n_ranges)
    assert whole_probe.ranged_copies == 4
    assert whole.losses == cut.losses
    assert all(torch.equal(whole.state[k], cut.state[k]) for k in whole.state)
    assert_parity(ref, cut)


def test_a_failing_range_raises_and_nothing_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    """An update that fails half-way through the ranges reaches the training loop as an error; the thread
    that feeds the device does not wait for ranges that will never be updated."""
    monkeypatch.setattr(pipeline, "RANGE_ELEMS", 80)
    original = StoreUpdate.range

    def failing(update: StoreUpdate, store: Any, lo: int, hi: int) -> None:
        if lo >= 160:
            raise RuntimeError("range update failed")
        original(update, store, lo, hi)

    monkeypatch.setattr(StoreUpdate, "range", failing)
    with pytest.raises(RuntimeError, match="range update failed"):
        fit(partial(ZOO["qwen2"], optimizer="adamw"), megatrain(grad_buffers=0), max_steps=3)
