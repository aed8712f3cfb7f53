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
import io
from functools import partial
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EMAWeightAveraging
from torch import nn

from compat_zoo import (DIM, BatchCounter, MLPBlock, TokenBlocks, VectorBlocks, assert_exact, compare_losses,
                        max_abs_diff, parity_or_refusal, refused_in_the_first_forward)
from conftest import compare_states, fit, megatrain

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


class L2AfterForward(TokenBlocks):
    """An explicit L2 penalty over every parameter, added once the forward has run."""

    def compute_loss(self, batch: Any) -> torch.Tensor:
        loss = super().compute_loss(batch)
        return loss + 1e-3 * sum(p.square().sum() for p in self.parameters())


class L2OnHeadBeforeForward(TokenBlocks):
    """An L2 penalty on the head and the final norm (used only after the last block), computed before the
    forward: their gradients from it arrive once the blocks' backward has begun."""

    def compute_loss(self, batch: Any) -> torch.Tensor:
        reg = sum(p.square().sum() for p in [*self.head.parameters(), *self.norm.parameters()])
        return super().compute_loss(batch) + 1e-3 * reg


class L2BeforeForward(TokenBlocks):
    """The L2 penalty over every parameter computed before the forward: the blocks' gradients from it arrive
    after their own have gone home."""

    def compute_loss(self, batch: Any) -> torch.Tensor:
        reg = sum(p.square().sum() for p in self.parameters())
        return super().compute_loss(batch) + 1e-3 * reg


@pytest.mark.parametrize("factory", [L2AfterForward, L2OnHeadBeforeForward])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_an_explicit_l2_term_trains_exactly(factory: Any, overlap: bool) -> None:
    """The head's term computed before the forward: the first backward watches, and the head's gradients
    then go home at the backward's end rather than at the first block's (they were refused mid-step)."""
    ref = fit(factory, None, max_steps=4)
    got = fit(factory, megatrain(overlap_optimizer=overlap), max_steps=4)
    assert_exact(ref, got)


def test_an_l2_term_on_block_weights_before_the_forward_is_refused_naming_the_fix() -> None:
    with pytest.raises(RuntimeError, match=r"parameter \S+ of streamed block \d \(MLPBlock\).*Compute such a term "
                                           r"after the forward"):
        fit(L2BeforeForward, "megatrain", max_steps=2)


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
    differentiates their own weights and inputs): refused in the first forward, naming it and the block class."""
    refused_in_the_first_forward(GainRead, r"\(GainBlock\) exactly: its forward reads gain, which it is not streamed")


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
    refused_in_the_first_forward(InPlaceInput, r"block 0 \(InPlaceInputBlock\) exactly: its forward changes one of "
                                               r"its input tensors \(or weights\) in place.*x = x \* a", **options)


# ---------------------------------------------------------------------------------------------
# activations kept beyond a block's outputs, and gradient hooks on block parameters
# ---------------------------------------------------------------------------------------------
class ActivationPenalty(TokenBlocks):
    """A forward hook on each block's ``fc1`` keeps its output; the loss adds their mean square (an activation
    regulariser). ``detached``: the hook keeps ``output.detach()`` and the loss ignores them (logging)."""

    detached = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.acts: list[torch.Tensor] = []
        for block in self.blocks:
            block.fc1.register_forward_hook(
                lambda m, a, out: self.acts.append(out.detach() if self.detached else out))

    def compute_loss(self, batch: Any) -> torch.Tensor:
        self.acts = []
        loss = super().compute_loss(batch)
        return loss if self.detached else loss + 0.1 * sum(a.pow(2).mean() for a in self.acts)


class ActivationLog(ActivationPenalty):
    detached = True


class AuxLossBlock(MLPBlock):
    """Keeps ``self.aux`` (the mean square of its hidden layer) for the loss, as hand-written MoE blocks keep
    their load-balancing loss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.norm(x))
        self.aux = h.pow(2).mean()
        return x + self.fc2(F.gelu(h))


class AuxLossAttribute(TokenBlocks):
    block_cls = AuxLossBlock

    def compute_loss(self, batch: Any) -> torch.Tensor:
        return super().compute_loss(batch) + 0.1 * sum(b.aux for b in self.blocks)


def _halve_grad(p: torch.Tensor) -> None:
    p.grad.mul_(0.5)


class GradHook(TokenBlocks):
    """A gradient hook on each block's ``fc1.weight`` halves its gradient (``post``: after accumulation)."""

    post = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for block in self.blocks:
            if self.post:
                block.fc1.weight.register_post_accumulate_grad_hook(_halve_grad)
            else:
                block.fc1.weight.register_hook(lambda g: g * 0.5)


class PostGradHook(GradHook):
    post = True


class LateGradHook(TokenBlocks):
    """The same hook, registered when training starts (after the strategy's setup)."""

    def on_train_start(self) -> None:
        for block in self.blocks:
            block.fc1.weight.register_hook(lambda g: g * 0.5)


class DictWriter(MLPBlock):
    """Writes its hidden layer into a dict it is handed (as Gemma3n's layers share keys through
    ``shared_kv_states``); the loss reads it from there."""

    def forward(self, x: torch.Tensor, notes: dict) -> torch.Tensor:
        h = self.fc1(self.norm(x))
        notes[len(notes)] = h
        return x + self.fc2(F.gelu(h))


class NotesInLoss(TokenBlocks):
    block_cls = DictWriter

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        self.notes: dict = {}
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, self.notes)
        return self.norm(h)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        return super().compute_loss(batch) + 0.1 * sum(h.pow(2).mean() for h in self.notes.values())


class BufferReplacing(MLPBlock):
    """Replaces a buffer in its forward with a new tensor (peft's VeLoRA keeps a batch average so): the recompute
    would start from the old one, and the binding of a streamed block's buffers would drop the new one."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean = x.detach().mean(dim=(0, 1))
        return x + self.fc2(F.gelu(self.fc1(self.norm(x - self.mean))))


class ReplacedBuffer(TokenBlocks):
    block_cls = BufferReplacing


@pytest.mark.parametrize("factory, pattern, options", [
    (ReplacedBuffer, r"changes its buffers in place or replaces them \(BufferReplacing\.mean \(BufferReplacing, replaced\)\)", {}),
    (ActivationPenalty, r"keeps tensors with a gradient history beyond its outputs \(blocks\.0\.fc1's output "
                        r"\(a forward hook\)\)", {}),
    (AuxLossAttribute, r"beyond its outputs \(blocks\.0\.aux\)", {}),
    (AuxLossAttribute, r"beyond its outputs \(blocks\.0\.aux\)", {"keep_activations": 3}),
    (NotesInLoss, r"beyond its outputs \(the dict passed as its argument 1\)", {}),
    (LateGradHook, r"blocks\.0\.fc1\.weight has a gradient hook", {}),
], ids=["replaced-buffer", "hooked-activation-in-loss", "aux-loss-attribute", "aux-loss-attribute-kept", "written-into-an-argument",
        "hook-added-in-training"])
def test_what_a_streamed_block_would_lose_is_refused_by_name(factory: Any, pattern: str, options: dict) -> None:
    """Silently wrong before: a loss term on an activation a hook kept, an attribute the block set or a container
    it wrote into (no gradient reached the block), a gradient hook on a block parameter (never ran). Now refused in
    the first forward, naming the tensor or parameter."""
    refused_in_the_first_forward(factory, pattern, **options)


@pytest.mark.parametrize("factory", [GradHook, PostGradHook], ids=["register_hook", "post-accumulate-hook"])
def test_gradient_hooks_on_block_parameters_are_refused_at_setup(factory: Any) -> None:
    """A gradient hook the module registers when it is built is refused at setup (peft's OSF registers them)."""
    counter = BatchCounter()
    with pytest.raises(ValueError, match=r"cannot train blocks\.0\.fc1\.weight exactly: it has a gradient hook"):
        fit(factory, "megatrain", max_steps=2, callbacks=[counter])
    assert counter.batches == 0


def test_a_hook_that_keeps_detached_activations_trains_exactly() -> None:
    """Logging what a submodule computes (``output.detach()``) is not refused, and trains as under the default
    strategy (the hook runs in the forward and again in the recompute: 2 calls per block and step)."""
    ref, got, refused = parity_or_refusal(ActivationLog, names=["fc1"], max_steps=3)
    assert refused is None


class LBFGSBlocks(TokenBlocks):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.1)


def test_lbfgs_is_refused_before_any_update() -> None:
    """LBFGS re-evaluates the loss inside its step (a closure): refused by name when the strategy takes the
    optimizer over (it used to fail in its first step, calling step() without the closure)."""
    counter = BatchCounter()
    with pytest.raises(TypeError, match=r"cannot step torch\.optim\.LBFGS"):
        fit(LBFGSBlocks, "megatrain", max_steps=1, callbacks=[counter])
    assert counter.batches == 0


def test_pruning_blocks_during_training_is_refused_by_name() -> None:
    """Lightning's ModelPruning re-registers a pruned Linear's weight (``weight_orig`` and a pre-hook) at an
    epoch's end; streaming would bind weights where the module no longer reads them (it used to crash in the
    next forward with "cannot assign 'torch.FloatTensor' as parameter 'weight'"). Refused by name before the next
    step, where the strategy takes back what callbacks wrote."""
    from lightning.pytorch.callbacks import ModelPruning

    class BlocksOnly(ModelPruning):
        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            self._parameters_to_prune = [(b.fc1, "weight") for b in pl_module.blocks]
            super().setup(trainer, pl_module, stage)

    fit(TokenBlocks, None, max_steps=6, callbacks=[BlocksOnly("l1_unstructured", amount=0.3)])
    with pytest.raises(RuntimeError, match=r"block 0 \(MLPBlock\): its parameter fc1\.weight was re-registered after setup.*Prune or "
                                           r"parametrize before fit"):
        fit(TokenBlocks, "megatrain", max_steps=6, callbacks=[BlocksOnly("l1_unstructured", amount=0.3)])


class WeightNormed(TokenBlocks):
    """Each block's ``fc1`` under weight normalisation: torch's old ``weight_norm`` (a pre-hook sets ``fc1.weight``
    as a plain attribute, recomputed before every forward: not an escaped activation) or the parametrization."""

    old = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for block in self.blocks:
            if self.old:
                torch.nn.utils.weight_norm(block.fc1)
            else:
                torch.nn.utils.parametrizations.weight_norm(block.fc1)


class WeightNormParametrized(WeightNormed):
    old = False


@pytest.mark.parametrize("factory", [WeightNormed, WeightNormParametrized], ids=["weight_norm", "parametrizations"])
def test_weight_norm_in_blocks_trains_exactly(factory: Any) -> None:
    ref, got, refused = parity_or_refusal(factory, names=["fc1"], max_steps=3)
    assert refused is None


class GradlessStore(TokenBlocks):
    """A step in which a whole store gets no gradient: ``training_step`` returns None for one batch (Lightning
    skips it), block 1 dropped on odd steps (LayerDrop), or block 1's gradients set to None before the step."""

    def __init__(self, case: str = "return_none", **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for j, block in enumerate(self.blocks):
            if not (self.hparams.case == "layer_drop" and j == 1 and self.global_step % 2 == 1):
                h = block(h)
        return self.norm(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        loss = super().training_step(batch, batch_idx)
        return None if self.hparams.case == "return_none" and batch_idx == 1 else loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.hparams.case == "grad_none" and self.global_step % 2 == 0:
            for p in self.blocks[1].parameters():
                p.grad = None


@pytest.mark.parametrize("case", ["return_none", "layer_drop", "grad_none"])
def test_a_step_leaving_a_block_without_gradients_trains_as_adamw_does(case: str) -> None:
    """AdamW skips a parameter without a gradient (no step count, no decay). A step that left a whole store so
    (Lightning's documented ``return None``, LayerDrop, gradients cleared in a hook) failed in the host AdamW's
    step count (2026-12-05's sweep of Trainer features); now as under the default strategy, state included."""
    factory = partial(GradlessStore, case=case)
    ref = fit(factory, None, max_steps=6)
    got = fit(factory, "megatrain", max_steps=6)
    assert ref.trainer.global_step == got.trainer.global_step
    compare_losses(ref.losses, got.losses)
    compare_states(ref.state, got.state)
    steps = lambda r: sorted(float(s["step"]) for s in r.trainer.optimizers[0].state.values())  # noqa: E731
    assert steps(ref) == steps(got)
    if case != "return_none":  # (a skipped batch skips the step for every parameter)
        assert min(steps(ref)) < max(steps(ref)), "no parameter sat a step out: the test would be vacuous"


class ActivationProbeBlock(MLPBlock):
    """Notes, in every forward run with gradients enabled, whether the graph holds GELU's input for its backward."""

    alive: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = F.gelu(self.fc1(self.norm(x)))
        if torch.is_grad_enabled():
            try:
                ActivationProbeBlock.alive.append(g.grad_fn._saved_self is not None)
            except RuntimeError:  # a graph that saved nothing
                ActivationProbeBlock.alive.append(False)
        return x + self.fc2(g)


class ActivationProbe(TokenBlocks):
    block_cls = ActivationProbeBlock


def test_the_first_forward_check_keeps_no_activations() -> None:
    """The first forward's check builds a graph only to walk it: the activations it saves are dropped as the
    block goes (they had piled up beside the saved block inputs and fragmented the device allocator: peak
    reserved grew with depth). The recompute's graph, which the backward runs, keeps them: the probe sees both."""
    ActivationProbeBlock.alive = []
    fit(ActivationProbe, "megatrain", max_steps=1)
    checked, recomputed = ActivationProbeBlock.alive[:3], ActivationProbeBlock.alive[3:]  # forward 0-2, then 2-0
    assert checked == [False] * 3 and recomputed == [True] * 3
    ref, got, refused = parity_or_refusal(ActivationProbe, names=[], max_steps=2)
    assert refused is None


class InnerGradBlock(MLPBlock):
    """Differentiates inside its forward: the gradient of an energy of its hidden layer, as force fields and
    gradient features do (``torch.autograd.grad`` with ``create_graph``, or ``torch.func.grad``), with dropout before
    it (the first call's check runs it again from the same random state)."""

    use_func = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.fc1(self.norm(x)), p=0.1, training=self.training)
        energy = lambda z: F.gelu(z).pow(2).sum()  # noqa: E731
        if self.use_func:
            force = torch.func.grad(energy)(h)
        else:
            with torch.enable_grad():
                z = h if h.requires_grad else h.detach().requires_grad_()
                (force,) = torch.autograd.grad(energy(z), z, create_graph=torch.is_grad_enabled())
        return x + self.fc2(force)


class InnerGrad(TokenBlocks):
    block_cls = InnerGradBlock


def test_a_block_differentiating_inside_its_forward_trains_exactly() -> None:
    """The first forward's check drops its graph's saved tensors; a block whose forward reads them (its own
    torch.autograd.grad) is called again keeping them, from the same random state (dropout): parity."""
    ref, got, refused = parity_or_refusal(InnerGrad, names=[], max_steps=3)
    assert refused is None


def test_a_block_calling_torch_func_is_refused_by_name(monkeypatch: Any) -> None:
    """torch.func refuses to run under saved-tensor hooks, which every streamed block's call runs under: it
    failed in the first training batch with torch's own message; now refused there by name, with the fix."""
    monkeypatch.setattr(InnerGradBlock, "use_func", True)
    refused_in_the_first_forward(InnerGrad, r"block 0 \(InnerGradBlock\) exactly: its forward calls a torch\.func "
                                 r"transform.*torch\.autograd\.grad inside the forward")


# ---------------------------------------------------------------------------------------------
# a copy of the model made during fit (an EMA or SWA model: copy.deepcopy once the strategy has set up)
# ---------------------------------------------------------------------------------------------
class CopyEMA(pl.Callback):
    """An EMA of the whole module, made by ``copy.deepcopy`` in ``on_train_start`` (after the strategy's setup, as
    timm's ModelEmaV3 in ``on_fit_start``), updated after every batch, and a check of one copied block: zeroed, its
    branch must compute zeros (its own weights), whatever the original computes."""

    def __init__(self) -> None:
        self.ema: Any = None
        self.pickled: Any = None
        self.zeroed_block_out: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.ema = copy.deepcopy(pl_module).requires_grad_(False)
        saved = io.BytesIO()
        torch.save(pl_module, saved)  # pickled whole (it failed on the strategy's closures)
        saved.seek(0)
        self.pickled = torch.load(saved, weights_only=False)
        twin = copy.deepcopy(pl_module.blocks[0])
        with torch.no_grad():
            for p in twin.parameters():
                p.zero_()
            x = torch.randn(2, DIM)
            self.zeroed_block_out = float((twin(x) - x).norm())  # the block's branch (it adds its input back)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        with torch.no_grad():
            for e, p in zip(self.ema.parameters(), pl_module.parameters()):
                e.mul_(0.5).add_(p.detach().to(e.device), alpha=0.5)


def test_a_deep_copy_made_during_fit_is_a_plain_module_of_its_own_weights() -> None:
    """Found 2026-12-07 (timm's ModelEmaV3 built in on_fit_start): the copy took the strategy's forward pre-hooks,
    and deepcopy followed them into the engine (TypeError: cannot pickle '_queue.SimpleQueue'); and a copied
    streamed block kept the original's forward, so it computed with the original's weights (a zeroed copy's
    branch was not 0). Now the copy is a plain module: the EMA computes what the default strategy's computes."""
    emas: list[CopyEMA] = []

    def callbacks() -> list[pl.Callback]:
        emas.append(CopyEMA())
        return [emas[-1]]

    ref = fit(TokenBlocks, None, callbacks=callbacks(), max_steps=4)
    got = fit(TokenBlocks, "megatrain", callbacks=callbacks(), max_steps=4)
    assert_exact(ref, got)
    assert emas[0].zeroed_block_out == 0.0 and emas[1].zeroed_block_out == 0.0
    compare_states(emas[0].ema.state_dict(), emas[1].ema.state_dict(), what="EMA state_dict")
    compare_states(emas[0].pickled.state_dict(), emas[1].pickled.state_dict(), what="pickled module")
    emas[1].pickled.zero_grad()  # its own: the strategy's hook is not carried over
    x = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref_out, got_out = (e.ema.eval().head(e.ema.trunk(x)) for e in emas)
    torch.testing.assert_close(got_out, ref_out, rtol=0, atol=1e-6)
