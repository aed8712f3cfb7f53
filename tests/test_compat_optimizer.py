"""The user's optimizer as they hold it: hyperparameters written during the step, Adam subclasses with
their own ``step``, its state emptied or loaded by the user mid-fit, the optimizer replaced mid-fit, and its
step pre-hooks.

Lightning's default strategy reads ``param_groups`` at ``optimizer.step()``, after the training step and the
hooks before the backward; a warm-up written by hand in ``training_step`` (or a callback's
``on_before_backward``) applies to that step. The strategy's overlapped host updates run during the backward,
so they must read the hyperparameters no earlier than the backward's start. A subclass of Adam/AdamW that
overrides ``step`` (gradient centralisation, a per-step tweak) must have that ``step`` run, not the flat
kernels of plain AdamW.
"""

from __future__ import annotations

import copy
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


# ---------------------------------------------------------------------------------------------
# the optimizer's state and the optimizer itself, changed by the user mid-fit
# ---------------------------------------------------------------------------------------------
class ClearStateAt(pl.Callback):
    """Restarts Adam at one step: ``optimizer.state.clear()`` (torch's Adam then starts from zero moments)."""

    def __init__(self, step: int = 3) -> None:
        self.step, self.done = step, False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step == self.step and not self.done:
            self.done = True
            trainer.optimizers[0].state.clear()


class LrFound(TokenBlocks):
    """What LearningRateFinder needs: a ``learning_rate`` attribute the optimizer is built from."""

    def __init__(self) -> None:
        super().__init__(n_val=8)
        self.learning_rate = 3e-3

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate, fused=True)


@pytest.mark.parametrize("case", ["state.clear()", "LearningRateFinder"])
def test_an_optimizer_state_emptied_mid_fit_restarts_from_zero_moments(case: str) -> None:
    """The state emptied by the user, or by the finder's restore of its state-less checkpoint after its trial
    steps: the flat moment buffers still held the old moments (4e-1 relative after 8 steps)."""
    from lightning.pytorch.callbacks import LearningRateFinder

    if case == "state.clear()":
        factory, callbacks, kw = TokenBlocks, lambda: [ClearStateAt()], {}
    else:
        factory, kw = LrFound, {"limit_val_batches": 2}
        callbacks = lambda: [LearningRateFinder(min_lr=1e-5, max_lr=1e-1, num_training_steps=5,  # noqa: E731
                                                early_stop_threshold=None)]
    ref = fit(factory, None, callbacks=callbacks(), **kw)
    got = fit(factory, "megatrain", callbacks=callbacks(), **kw)
    assert_exact(ref, got)


class LoadStateOnTrainStart(pl.Callback):
    """The user's own ``optimizer.load_state_dict`` after the strategy's setup."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.optimizers[0].load_state_dict(copy.deepcopy(self.state))


def test_a_users_load_state_dict_after_setup_takes_the_loaded_moments() -> None:
    """The loaded step counts were used but the moments dropped (5e-1 relative)."""
    first = fit(TokenBlocks, None, max_steps=3)
    state = copy.deepcopy(first.trainer.optimizers[0].state_dict())
    ref = fit(TokenBlocks, None, max_steps=4, callbacks=[LoadStateOnTrainStart(state)])
    got = fit(TokenBlocks, "megatrain", max_steps=4, callbacks=[LoadStateOnTrainStart(state)])
    assert_exact(ref, got)
    p = got.module.blocks[0].fc1.weight
    assert float(got.trainer.optimizers[0].state[p]["step"]) == 7.0


class ReplaceOptimizerAt(pl.Callback):
    """Replaces the optimizer mid-fit, as a user would: ``trainer.optimizers = [...]`` or Lightning's own
    ``strategy.setup_optimizers`` (the module's configure_optimizers again)."""

    def __init__(self, how: str, step: int = 3) -> None:
        self.how, self.step, self.done = how, step, False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step == self.step and not self.done:
            self.done = True
            if self.how == "assign":
                trainer.optimizers = [torch.optim.SGD(pl_module.parameters(), lr=0.1, momentum=0.9)]
            else:
                trainer.strategy.setup_optimizers(trainer)


@pytest.mark.parametrize("how", ["assign", "setup_optimizers"])
def test_an_optimizer_replaced_mid_fit_is_stepped_on_the_host_like_the_first(how: str) -> None:
    """The new optimizer's zero_grad never cleared the resident gradients (they grew step by step: 2.6
    relative) and it ran outside the host optimizer."""
    ref = fit(TokenBlocks, None, callbacks=[ReplaceOptimizerAt(how)])
    got = fit(TokenBlocks, "megatrain", callbacks=[ReplaceOptimizerAt(how)])
    assert_exact(ref, got)
    hosts = got.trainer.strategy.precision_plugin.host_optimizers  # emptied at teardown
    assert hosts == {}


class PreHookScalesGradients(TokenBlocks):
    """An optimizer step pre-hook that scales the gradients it sees and counts them. Lightning's default
    strategy runs it inside ``optimizer.step(closure)`` before the closure: it sees the step before's gradients,
    which the closure's zero_grad then clears (so the scaling has no effect on training)."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__(optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 3e-3)
        self.seen: list[int] = []

    def configure_optimizers(self) -> Any:
        opt = super().configure_optimizers()

        def pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            for g in grads:
                g.mul_(0.3)
            self.seen.append(len(grads))

        opt.register_step_pre_hook(pre_hook)
        return opt


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_step_pre_hooks_run_where_the_default_strategy_runs_them(optimizer: str) -> None:
    """Before the closure (they ran after the backward and scaled this step's gradients: 4e-1 relative)."""
    ref = fit(lambda: PreHookScalesGradients(optimizer), None, max_steps=4)
    got = fit(lambda: PreHookScalesGradients(optimizer), "megatrain", max_steps=4)
    assert ref.module.seen[0] == 0 and ref.module.seen[1] > 0
    assert got.module.seen == ref.module.seen
    assert_exact(ref, got)


class PostHookClipsWeights(TokenBlocks):
    """Weight clipping in an optimizer step post-hook (WGAN style): every weight clamped after each step."""

    def configure_optimizers(self) -> Any:
        opt = super().configure_optimizers()

        def post_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            with torch.no_grad():
                for p in self.parameters():
                    p.clamp_(-0.05, 0.05)

        opt.register_step_post_hook(post_hook)
        return opt


@pytest.mark.parametrize("options", [{}, {"update_on_device": True}, {"update_on_device": 2, "cache_weights": 2}],
                         ids=["host", "update_on_device", "update_on_device-2-cached"])
def test_weights_a_step_post_hook_writes_reach_the_next_forward(options: dict) -> None:
    """The embedding's and the first blocks' device copies, updated on the device, were kept for the next
    forward without the post-hook's clamp (2.4e-1 relative after 4 steps)."""
    ref = fit(PostHookClipsWeights, None, max_steps=4)
    got = fit(PostHookClipsWeights, megatrain(**options), max_steps=4)
    assert_exact(ref, got)


class SAM(torch.optim.SGD):
    """Sharpness-aware minimisation as commonly written: its step needs the closure (a second forward and backward
    at perturbed weights)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        assert closure is not None, "SAM requires closure"
        with torch.enable_grad():
            loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["e"] = e = 0.05 * p.grad / (p.grad.norm() + 1e-12)
                    p.add_(e)
        with torch.enable_grad():
            closure()
        for group in self.param_groups:
            for p in group["params"]:
                if "e" in self.state[p]:
                    p.sub_(self.state[p]["e"])
        super().step()
        return loss


class SAMBlocks(TokenBlocks):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return SAM(self.parameters(), lr=0.05)


def test_an_optimizer_that_needs_the_closure_fails_with_a_note_naming_it_and_the_fix() -> None:
    """The default strategy trains it; the strategy cannot run a step's forward and backward again inside the
    update: the optimizer's own error carries a note (it was a bare AssertionError), and no weight changed."""
    fit(SAMBlocks, None, max_steps=2)
    built: list[Any] = []

    def build() -> pl.LightningModule:
        built.append(SAMBlocks())
        built.append(copy.deepcopy(built[0].state_dict()))
        return built[0]

    with pytest.raises(AssertionError, match="SAM requires closure") as err:
        fit(build, "megatrain", max_steps=2)
    notes = " ".join(getattr(err.value, "__notes__", []))
    assert "SAM.step() was called without a closure" in notes and "re-evaluates the loss" in notes, notes
    module, before = built
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
