"""The user's optimizer as they hold it: hyperparameters written during the step, and Adam subclasses with
their own ``step``.

Lightning's default strategy reads ``param_groups`` at ``optimizer.step()``, after the training step and the
hooks before the backward; a warm-up written by hand in ``training_step`` (or a callback's
``on_before_backward``) applies to that step. The strategy's overlapped host updates run during the backward,
so they must read the hyperparameters no earlier than the backward's start. A subclass of Adam/AdamW that
overrides ``step`` (gradient centralisation, a per-step tweak) must have that ``step`` run, not the flat
kernels of plain AdamW.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from compat_zoo import TokenBlocks, assert_exact
from conftest import fit, megatrain

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class EarlyUpdates(pl.Callback):
    """How many stores the host optimizer updated during a backward (the overlap), over the run."""

    megatrain_reads_weights = False

    def __init__(self) -> None:
        self.count = 0

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        hosts = getattr(trainer.strategy.precision_plugin, "host_optimizers", {})
        self.count = sum(h.early_updates for h in hosts.values())


def warmup(step: int) -> float:
    return 3e-3 * min(1.0, (step + 1) / 4)


class LrInTrainingStep(TokenBlocks):
    """A warm-up by hand: lr, betas and weight decay written into the param groups in ``training_step``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        for group in self.optimizers().optimizer.param_groups:
            group["lr"] = warmup(self.global_step)
            group["betas"] = (0.9 - 0.1 * (self.global_step % 2), 0.95)
            group["weight_decay"] = 0.01 * (1 + self.global_step)
        return super().training_step(batch, batch_idx)


class LrBeforeBackward(TokenBlocks):
    """The same warm-up written by the module's ``on_before_backward`` hook."""

    def on_before_backward(self, loss: torch.Tensor) -> None:
        for group in self.optimizers().optimizer.param_groups:
            group["lr"] = warmup(self.global_step)


class LrInBackward(TokenBlocks):
    """The warm-up written by the module's own ``backward`` before it calls ``loss.backward()``: a hook the
    strategy cannot see into, so its updates wait for the step (no overlap)."""

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        for group in self.optimizers().optimizer.param_groups:
            group["lr"] = warmup(self.global_step)
        loss.backward(*args, **kwargs)


class WarmupCallback(pl.Callback):
    """The warm-up written by a callback's ``on_before_backward``."""

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = warmup(trainer.global_step)


@pytest.mark.parametrize(
    "factory, callbacks, overlaps",
    [(LrInTrainingStep, (), True), (LrBeforeBackward, (), True), (TokenBlocks, (WarmupCallback,), True),
     (LrInBackward, (), False)],
    ids=["training_step", "module-on_before_backward", "callback-on_before_backward", "module-backward"],
)
def test_hyperparameters_written_before_the_backward_apply_to_that_step(factory: Any, callbacks: tuple,
                                                                        overlaps: bool) -> None:
    """Exact; the host updates overlap the backward where they may (counted: the test sees the read's timing)."""
    ref = fit(factory, None, max_steps=6, callbacks=[cb() for cb in callbacks])
    probe = EarlyUpdates()
    got = fit(factory, "megatrain", max_steps=6, callbacks=[*(cb() for cb in callbacks), probe])
    assert (probe.count > 0) == overlaps, f"{probe.count} host updates overlapped a backward"
    assert_exact(ref, got)


class CentralisedAdamW(torch.optim.AdamW):
    """AdamW with gradient centralisation: each matrix's gradient re-centred in ``step`` before AdamW's."""

    calls = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        type(self).calls += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.ndim >= 2:
                    p.grad.sub_(p.grad.mean(dim=1, keepdim=True))
        super().step()
        return loss


class CentralisedBlocks(TokenBlocks):
    def configure_optimizers(self) -> Any:
        return CentralisedAdamW(self.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01, fused=True)


def test_an_adam_subclass_with_its_own_step_runs_it() -> None:
    CentralisedAdamW.calls = 0
    ref = fit(CentralisedBlocks, None, max_steps=6)
    assert CentralisedAdamW.calls == 6
    got = fit(CentralisedBlocks, "megatrain", max_steps=6)
    assert CentralisedAdamW.calls == 12, "the subclass's step() did not run under megatrain"
    assert_exact(ref, got)


def test_compact_host_state_refuses_an_adam_subclass_with_its_own_step_by_name() -> None:
    with pytest.raises(ValueError, match=r"CentralisedAdamW \(a subclass with its own step\(\)"):
        fit(CentralisedBlocks, megatrain(host_state="compact"), max_steps=1)
