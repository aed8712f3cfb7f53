"""An untied input embedding updated in two halves (``split_embedding_update=True``, ``engine/sparse_rows.py``).

While the backward runs, every row is updated with a zero gradient (the looked-up rows' state set aside);
at its end, the looked-up rows from their gradients. The tiny models look up at most 64 of their 96 rows per
step, so both halves matter. The run must equal the whole-table update bit for bit and match Lightning's
default strategy; where the split does not apply (a tied head, accumulation) the engine updates the table
whole; where the table's gradient is not row-sparse after all, training stops with an error.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from conftest import assert_parity, fit, megatrain
from zoo import ZOO, TinyLlama


class SplitProbe(pl.Callback):
    megatrain_reads_weights = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        split = trainer.strategy.engine._split
        self.applies = split is not None
        self.steps = split.steps if split is not None else 0


def _fit_split(factory: Any, split: bool, **kwargs: Any) -> tuple[Any, SplitProbe]:
    probe = SplitProbe()
    run = fit(factory, megatrain(split_embedding_update=split), callbacks=[probe], **kwargs)
    return run, probe


def test_split_update_equals_the_whole_update_bit_for_bit() -> None:
    factory = partial(ZOO["llama"], optimizer="adamw", param_groups=True, scheduler=True)  # untied head
    ref = fit(factory, None, max_steps=6)
    whole, _ = _fit_split(factory, False, max_steps=6)
    split, probe = _fit_split(factory, True, max_steps=6)
    assert probe.applies and probe.steps == 6
    assert split.losses == whole.losses
    assert all(torch.equal(whole.state[k], split.state[k]) for k in whole.state)
    emb = "model.model.embed_tokens.weight"
    assert not torch.equal(split.init_state[emb], split.state[emb])
    assert_parity(ref, split)


@pytest.mark.parametrize(
    ("factory", "kwargs"),
    [
        (partial(ZOO["qwen2"], optimizer="adamw"), {}),  # tied head: the table's gradient is dense
        (partial(ZOO["llama"], optimizer="adamw"), {"accumulate_grad_batches": 2}),  # host gradients to add in
    ],
    ids=["tied", "accumulation"],
)
def test_where_the_split_does_not_apply_the_table_is_updated_whole(factory: Any, kwargs: dict) -> None:
    ref = fit(factory, None, max_steps=4, **kwargs)
    got, probe = _fit_split(factory, True, max_steps=4, **kwargs)
    assert probe.steps == 0
    assert_parity(ref, got)


class EmbeddingPenalty(TinyLlama):
    """Reads the embedding table outside its lookup: its gradient is dense, the split would be wrong."""

    def compute_loss(self, batch: Any) -> torch.Tensor:
        return super().compute_loss(batch) + 1e-4 * self.model.model.embed_tokens.weight.square().sum()


def test_a_table_whose_gradient_is_not_row_sparse_stops_training() -> None:
    with pytest.raises(RuntimeError, match="split_embedding_update"):
        _fit_split(partial(EmbeddingPenalty, optimizer="adamw"), True, max_steps=3)
    run, probe = _fit_split(partial(EmbeddingPenalty, optimizer="adamw"), False, max_steps=3)  # whole: fine
    assert probe.steps == 0 and len(run.losses) == 3


def test_an_embedding_left_out_of_the_optimizer_is_not_split() -> None:
    """The optimizer steps only the blocks and the head: the table must stay as it was, as natively."""

    class NoEmbeddingInOptimizer(TinyLlama):
        def configure_optimizers(self) -> Any:
            emb = self.model.model.embed_tokens.weight
            return torch.optim.AdamW([p for p in self.parameters() if p is not emb], lr=3e-3, fused=True)

    factory = partial(NoEmbeddingInOptimizer, optimizer="adamw", scheduler=False)
    ref = fit(factory, None, max_steps=3)
    got, probe = _fit_split(factory, True, max_steps=3)
    assert probe.applies and probe.steps == 0
    emb = "model.model.embed_tokens.weight"
    assert torch.equal(got.state[emb], got.init_state[emb])
    assert_parity(ref, got)
