"""Issue 13, cases 3-5: block state that changes outside the optimizer, and block weights read outside
their block.

3. A block buffer updated in the forward (BatchNorm1d running statistics): exact, or a refusal at setup
   naming the module.
4. Weights changed in place between steps: Lightning's EMAWeightAveraging (it swaps the averaged weights
   in for validation and copies them in at the end), ``load_state_dict`` from a callback, a user's
   ``p.copy_()`` under ``no_grad`` in ``on_train_batch_start``. The result must equal the default
   strategy's. Variants with validation (which loads weights onto the device between two training
   steps) and with gradient accumulation (no optimizer step between two micro-batches).
5. A block parameter used outside its block (a regulariser in the root's loss, an unregistered tie):
   exact, or a refusal at setup naming the parameter.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EMAWeightAveraging
from torch import nn

from compat_zoo import (DIM, BatchCounter, MLPBlock, TokenBlocks, VectorBlocks, assert_exact, compare_losses,
                        max_abs_diff, parity_or_refusal)
from conftest import fit, megatrain

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# ---------------------------------------------------------------------------------------------
# case 3: BatchNorm1d inside a block
# ---------------------------------------------------------------------------------------------
class BNBlock(nn.Module):
    """x + fc2(ReLU(BatchNorm1d(fc1(x)))): running_mean, running_var and num_batches_tracked change in
    every training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.bn = nn.BatchNorm1d(2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.bn(self.fc1(x))))


class BNVectors(VectorBlocks):
    block_cls = BNBlock


def test_batchnorm_block_parity_or_refusal() -> None:
    """4 steps; the final state_dict holds each block's running statistics and batch count. Exact, or
    refused at setup naming ``blocks.0.bn`` and ``BatchNorm1d``."""
    ref, got, refused = parity_or_refusal(BNVectors, names=["blocks.0.bn", "BatchNorm1d"], max_steps=4)
    assert int(ref.state["blocks.0.bn.num_batches_tracked"]) == 4
    if got is not None:
        assert int(got.state["blocks.0.bn.num_batches_tracked"]) == 4


# ---------------------------------------------------------------------------------------------
# case 4: weights changed in place outside the optimizer
# ---------------------------------------------------------------------------------------------
VARIANTS: dict[str, dict[str, Any]] = {
    # 2 epochs of 3 steps, no validation
    "plain": dict(max_epochs=2, max_steps=-1),
    # the same with 2 validation batches after each epoch (validation streams the weights in between)
    "validation": dict(max_epochs=2, max_steps=-1, n_val=8, limit_val_batches=2, check_val_every_n_epoch=1),
    # 1 epoch of 6 micro-batches, 2 per optimizer step
    "accumulate": dict(max_epochs=1, max_steps=-1, accumulate_grad_batches=2),
}


def _run_both(factory: Any, variant: str, callbacks: Any = tuple) -> tuple[Any, Any]:
    kw = dict(VARIANTS[variant])
    n_val = kw.pop("n_val", 0)
    factory = partial(factory, n_val=n_val)
    ref = fit(factory, None, callbacks=callbacks(), **kw)
    got = fit(factory, "megatrain", callbacks=callbacks(), **kw)
    return ref, got


def _assert_same(ref: Any, got: Any) -> None:
    if ref.module.val_losses:
        compare_losses(ref.module.val_losses, got.module.val_losses, what="validation loss")
    try:
        assert_exact(ref, got)
    except AssertionError as err:
        raise AssertionError(f"{err}\n(max abs parameter difference {max_abs_diff(ref.state, got.state):.3g})") from None


@pytest.mark.parametrize("variant", ["plain", "validation"])
def test_ema_weight_averaging_parity(variant: str) -> None:
    """Lightning's EMAWeightAveraging (decay 0.5: the average moves visibly in 6 steps). It reads the
    weights after every step, swaps the average in for validation and back after it, and copies the
    average into the module when training ends."""
    ref, got = _run_both(TokenBlocks, variant, lambda: [EMAWeightAveraging(decay=0.5)])
    _assert_same(ref, got)


class RewindAtEpoch(pl.Callback):
    """Loads the weights the module had when training started, with ``load_state_dict``, at the start of
    epoch 1 (the optimizer keeps its state: "rewind the weights, keep the moments")."""

    def __init__(self) -> None:
        self.saved: dict[str, torch.Tensor] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.saved = copy.deepcopy(pl_module.state_dict())

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            assert self.saved is not None
            pl_module.load_state_dict(self.saved)


@pytest.mark.parametrize("variant", ["plain", "validation"])
def test_load_state_dict_from_callback_parity(variant: str) -> None:
    ref, got = _run_both(TokenBlocks, variant, lambda: [RewindAtEpoch()])
    _assert_same(ref, got)


class ShrunkBlocks(TokenBlocks):
    """Weight decay by hand: every block matrix is scaled by 0.9 with ``p.copy_()`` under ``no_grad`` at
    the start of every training batch (micro-batch, under accumulation), so the weights change between
    any two forwards."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            for p in self.blocks.parameters():
                if p.ndim == 2:
                    p.copy_(0.9 * p)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_user_copy_in_on_train_batch_start_parity(variant: str) -> None:
    ref, got = _run_both(ShrunkBlocks, variant)
    _assert_same(ref, got)


# ---------------------------------------------------------------------------------------------
# case 5: a block parameter used outside its block
# ---------------------------------------------------------------------------------------------
class RegularisedBlocks(TokenBlocks):
    """The loss adds an L2 term on ``self.blocks[0].fc1.weight``, read by the root's code directly."""

    def compute_loss(self, batch: Any) -> torch.Tensor:
        return super().compute_loss(batch) + 0.05 * self.blocks[0].fc1.weight.square().sum()


class UnregisteredTie(TokenBlocks):
    """An auxiliary projection that reuses the last block's ``fc1`` (a plain attribute, not a registered
    submodule: the tie is invisible to ``named_parameters``). Its output enters the loss."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.__dict__["aux_proj"] = self.blocks[-1].fc1  # not registered

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (x,) = batch
        h = self.trunk(x)
        y = (7 * x + 3) % self.head.out_features
        main = F.cross_entropy(self.head(h).reshape(-1, self.head.out_features), y.reshape(-1))
        return main + 0.1 * self.aux_proj(h).square().mean()


@pytest.mark.parametrize(
    "factory, names",
    [(RegularisedBlocks, ["blocks.0.fc1.weight"]), (UnregisteredTie, ["blocks.2.fc1"])],
    ids=["root-regulariser", "unregistered-tie"],
)
def test_block_parameter_used_outside_its_block(factory: Any, names: list[str]) -> None:
    """Exact, or refused at setup naming the parameter (or module) read outside its block."""
    parity_or_refusal(factory, names=names, max_steps=4)


# ---------------------------------------------------------------------------------------------
# a resident parameter read inside a block
# ---------------------------------------------------------------------------------------------
class GainBlock(nn.Module):
    """MLPBlock whose hidden state is scaled by the model's ``gain``: read through a plain attribute
    (``owner``, not a registered submodule) or handed in as an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.owner: list[nn.Module] = []

    def forward(self, x: torch.Tensor, gain: torch.Tensor | None = None) -> torch.Tensor:
        gain = self.owner[0].gain if gain is None else gain
        return x + self.fc2(F.gelu(self.fc1(self.norm(x) * gain)))


class GainRead(TokenBlocks):
    """A root parameter ``gain`` that every block reads through its ``owner`` attribute."""

    block_cls = GainBlock
    passed = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gain = nn.Parameter(torch.full((DIM,), 1.5))
        for block in self.blocks:
            block.owner = [self]

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, self.gain) if self.passed else block(h)
        return self.norm(h)


class GainPassed(GainRead):
    passed = True


def test_resident_parameter_read_inside_a_block_is_refused_before_any_update() -> None:
    """Read through a plain attribute, ``gain`` would get no gradient from the streamed blocks (their backward
    differentiates their own weights and inputs): refused in the first forward, naming it and the block class,
    the weights as they were."""
    counter, built = BatchCounter(), []

    def factory() -> GainRead:
        built.append(GainRead())
        built.append(copy.deepcopy(built[0].state_dict()))
        return built[0]

    with pytest.raises(RuntimeError, match=r"\(GainBlock\) exactly: its forward reads gain, which it is not streamed"):
        fit(factory, "megatrain", max_steps=2, callbacks=[counter])
    assert counter.batches == 1
    module, before = built
    after = module.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k].cpu())]
    assert not changed, f"weights changed in the refused step: {changed}"


def test_resident_parameter_passed_to_the_blocks_trains_exactly() -> None:
    """The fix the refusal names: the same parameter handed to each block as an argument gets its gradient."""
    ref, got, refused = parity_or_refusal(GainPassed, names=["gain"], max_steps=4)
    assert refused is None and got is not None
    assert not torch.equal(ref.init_state["gain"], ref.state["gain"])


class InPlaceInputBlock(MLPBlock):
    """Scales its input in place before the usual MLP: fine under the default strategy (nothing saved that
    tensor), but a streamed block recomputes from its saved input, which the forward has changed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.9)
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class InPlaceInput(TokenBlocks):
    block_cls = InPlaceInputBlock

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) * 1.0  # the first block's input is not the embedding's weight view
        for block in self.blocks:
            h = block(h)
        return self.norm(h)


@pytest.mark.parametrize("options", [{}, {"keep_activations": 3}], ids=["recomputed", "kept"])
def test_block_changing_its_input_in_place_is_refused_at_its_first_forward(options: dict) -> None:
    """The reference trains; under megatrain the first forward is refused naming the block and the fix (a kept
    block's inputs are leaves, where autograd's own error is replaced by the strategy's)."""
    fit(InPlaceInput, None, max_steps=2)
    counter = BatchCounter()
    with pytest.raises(RuntimeError, match=r"block 0 \(InPlaceInputBlock\) exactly: its forward changes one of its "
                                           r"input tensors \(or weights\) in place.*x = x \* a"):
        fit(InPlaceInput, megatrain(**options), max_steps=2, callbacks=[counter])
    assert counter.batches == 1
