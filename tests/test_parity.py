"""Parity of `Trainer(strategy="megatrain")` with Lightning's default strategy (issue 2), on the
CPU in fp32, through the public API only: every micro-batch loss within 1e-5 relative, every
final state_dict tensor within 1e-5 in ||delta||/||ref||, same keys, host tensors.

The nn.MultiheadAttention modules (encoder, transformer) are compared with SGD: their key
projection bias has an analytically zero gradient, which Adam would turn from rounding noise
into lr-sized steps of random sign.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from conftest import (
    assert_is_megatrain,
    assert_parity,
    compare_losses,
    compare_states,
    fit,
    megatrain,
    rel_diff,
    run_parity,
)
from megatrain_lightning.checkpoint_io import ShardedCheckpointIO
from zoo import ZOO, LinearOnly, ResidualMLPBlock, TinyLlama, UserBlocks


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# AdamW cases. Qwen2's key-projection bias starts at zero and its gradient is nearly zero (a
# constant key bias shifts every logit of a query row alike; only RoPE's slow rotation of it
# survives the softmax), so rounding-level differences become visible in ||delta||/||ref||:
# torch's own fused and foreach AdamW end 5.4e-5 apart there (1.5e-5 with eps 1e-6).
ADAMW_MODELS = ["llama", "qwen2", "gpt_oss", "user"]
LOOSE: dict[str, dict[str, float]] = {"qwen2": {"self_attn.k_proj.bias": 2e-4}}


def adamw_factory(name: str, **kwargs: Any) -> Any:
    return partial(ZOO[name], optimizer="adamw", lr=3e-3, scheduler=True, **kwargs)


# ---------------------------------------------------------------------------------------------
# the harness itself: it fails on real differences and accepts rounding-level ones
# ---------------------------------------------------------------------------------------------
def test_harness_detects_divergence() -> None:
    """Native vs native passes; a 0.1% learning-rate change or one changed token fails."""
    ref, same = run_parity(UserBlocks, strategy=None)
    perturbed_lr = fit(partial(UserBlocks, lr=3e-3 * 1.001))
    with pytest.raises(AssertionError, match="loss: 6/8 values differ"):
        assert_parity(ref, perturbed_lr)
    with pytest.raises(AssertionError, match="state_dict: .* tensors differ"):
        compare_states(ref.state, perturbed_lr.state)

    class OneTokenOff(UserBlocks):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.train_data[5, 3] = (self.train_data[5, 3] + 1) % 96  # a token of micro-batch 1

    with pytest.raises(AssertionError, match=r"loss: 7/8 values differ.*first: #1"):
        compare_losses(ref.losses, fit(OneTokenOff).losses)


@pytest.mark.parametrize("name", [*ADAMW_MODELS, "llama-groups"])
def test_harness_accepts_other_adamw_implementation(name: str) -> None:
    """torch's foreach and fused AdamW (both correct, rounding differently) pass each other's
    parity check: the tolerances leave room for a host optimizer that is not bitwise torch's."""
    if name == "llama-groups":
        factory: Any = partial(TinyLlama, param_groups=True, weight_decay=0.1)
    else:
        factory = adamw_factory(name)
    ref = fit(partial(factory, adam_impl="foreach"))
    fused = fit(partial(factory, adam_impl="fused"))
    assert_parity(ref, fused, loose=LOOSE.get(name))


# ---------------------------------------------------------------------------------------------
# every model of the zoo
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ADAMW_MODELS)
def test_parity_adamw_stepwise_scheduler(name: str) -> None:
    """AdamW + LambdaLR stepped every optimizer step."""
    run_parity(adamw_factory(name), max_steps=8, loose=LOOSE.get(name))


@pytest.mark.parametrize("name", ["encoder", "transformer"])
def test_parity_mha_modules_sgd(name: str) -> None:
    """nn.TransformerEncoder (dropout 0.1 on: recompute must replay the masks) and nn.Transformer
    (two block lists; decoder blocks take `memory` as a second differentiable input), SGD with
    momentum + step-wise LambdaLR."""
    run_parity(partial(ZOO[name], optimizer="sgd", lr=0.05, momentum=0.9, scheduler=True), max_steps=8)


def test_parity_sgd_momentum_hf_tied() -> None:
    """SGD with momentum and weight decay on a Hugging Face model with tied embeddings."""
    run_parity(partial(ZOO["qwen2"], optimizer="sgd", lr=0.2, momentum=0.9, weight_decay=0.01, scheduler=False), max_steps=8)


def test_parity_adamw_param_groups() -> None:
    """AdamW with two param groups (decay on matrices, none on norms/biases) + scheduler."""
    ref, got = run_parity(partial(TinyLlama, param_groups=True, weight_decay=0.1), max_steps=8)
    assert len(got.trainer.optimizers[0].param_groups) == 2
    assert [g["weight_decay"] for g in got.trainer.optimizers[0].param_groups] == [0.1, 0.0]


# ---------------------------------------------------------------------------------------------
# accumulation and clipping
# ---------------------------------------------------------------------------------------------
CLIP = 0.05


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, optimizer, lr", [("llama", "sgd", 0.5), ("user", "sgd", 0.5), ("llama", "adamw", 3e-3)], ids=["llama-sgd", "user-sgd", "llama-adamw"]
)
def test_parity_accumulate_and_clip(name: str, optimizer: str, lr: float) -> None:
    """accumulate_grad_batches=2 + gradient_clip_val (norm) small enough that every step clips.
    SGD is what makes a wrong clip visible (Adam is nearly invariant to a uniform gradient scale),
    so SGD runs here too; the test also checks that skipping the clip would have been caught."""
    factory = partial(ZOO[name], optimizer=optimizer, lr=lr, scheduler=True)
    kwargs = dict(max_steps=5, accumulate_grad_batches=2, record_grad_norms=True)
    ref, got = run_parity(factory, gradient_clip_val=CLIP, gradient_clip_algorithm="norm", **kwargs)
    assert len(ref.losses) == 10 and ref.trainer.global_step == 5
    # The unclipped global norm (seen in on_before_optimizer_step, before clipping) exceeds the
    # clip value at every step, so clipping really acted.
    ref_norms, got_norms = ref.recorder.global_grad_norms(), got.recorder.global_grad_norms()
    assert len(ref_norms) == 5 and min(ref_norms) > CLIP, ref_norms
    compare_losses(ref_norms, got_norms, 1e-5, "unclipped global grad norm")
    if optimizer == "sgd":
        unclipped = fit(factory, None, **kwargs)
        with pytest.raises(AssertionError, match="state_dict"):
            compare_states(ref.state, unclipped.state)


# ---------------------------------------------------------------------------------------------
# resume from a checkpoint taken at an epoch boundary
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_resume_parity(tmp_path: Any) -> None:
    """3 epochs of 3 batches. Interrupted megatrain run: epoch 1 with a ModelCheckpoint, then a
    new Trainer and a module built from ANOTHER seed resume from that checkpoint. The resumed
    losses and final weights match the uninterrupted megatrain run and the native run."""
    factory = partial(TinyLlama, n_train=12, batch_size=4, optimizer="adamw", scheduler=True)
    full_native = fit(factory, None, max_epochs=3, max_steps=-1)
    full_mega = fit(factory, "megatrain", max_epochs=3, max_steps=-1)
    assert len(full_native.losses) == 9
    assert_parity(full_native, full_mega)

    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    first = fit(factory, "megatrain", max_epochs=1, max_steps=-1, callbacks=[ckpt], enable_checkpointing=True)
    path = tmp_path / "epoch=0.ckpt"
    assert path.exists(), sorted(p.name for p in tmp_path.iterdir())
    compare_losses(full_native.losses[:3], first.losses, what="loss before the checkpoint")
    saved = ShardedCheckpointIO().load_checkpoint(path, weights_only=False)  # the strategy's default format
    assert set(saved["state_dict"]) == set(full_native.state), "checkpoint state_dict keys differ from the module's"
    compare_states(first.state, saved["state_dict"], what="checkpoint state_dict")

    resumed = fit(factory, "megatrain", seed=1, max_epochs=3, max_steps=-1, ckpt_path=str(path))
    assert_is_megatrain(resumed)
    assert resumed.trainer.global_step == 9
    compare_losses(full_mega.losses[3:], resumed.losses, what="loss after resume vs uninterrupted megatrain")
    compare_losses(full_native.losses[3:], resumed.losses, what="loss after resume vs native")
    compare_states(full_mega.state, resumed.state, what="resumed vs uninterrupted megatrain")
    compare_states(full_native.state, resumed.state, what="resumed vs native")


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "encoder"])
def test_validation_parity(name: str) -> None:
    """validation_step logs val_loss: same values with both strategies, sanity check included.
    The encoder has dropout on in training, so validation must run the blocks in eval mode."""
    kwargs = dict(
        max_epochs=2, max_steps=-1, limit_val_batches=None, num_sanity_val_steps=2, check_val_every_n_epoch=1
    )
    ref, got = run_parity(partial(ZOO[name], n_train=12, n_val=8), **kwargs)
    assert len(ref.module.val_losses) == 2 + 2 * 2  # sanity + 2 epochs x 2 batches
    compare_losses(ref.module.val_losses, got.module.val_losses, what="val loss")
    compare_losses(
        [float(ref.trainer.callback_metrics["val_loss"])], [float(got.trainer.callback_metrics["val_loss"])], what="logged val_loss"
    )
    # trainer.validate after fit, on the trained weights
    ref_val = ref.trainer.validate(ref.module, verbose=False)[0]["val_loss"]
    got_val = got.trainer.validate(got.module, verbose=False)[0]["val_loss"]
    compare_losses([ref_val], [got_val], what="trainer.validate val_loss")


# ---------------------------------------------------------------------------------------------
# user hooks around the optimizer step
# ---------------------------------------------------------------------------------------------
class HookMixin:
    """Overrides `optimizer_step` (manual warm-up on the optimizer the user sees, as Lightning's docs
    show) and records the gradients seen in `on_before_optimizer_step`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(scheduler=False, **kwargs)
        self.optimizer_step_calls = 0
        self.seen_grads: list[dict[str, torch.Tensor]] = []

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        self.optimizer_step_calls += 1
        scale = min(1.0, (self.trainer.global_step + 1) / 4)
        for group in optimizer.param_groups:
            group["lr"] = scale * self.hparams.lr
        optimizer.step(closure=optimizer_closure)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen_grads.append({n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None})


class HookedLlama(HookMixin, TinyLlama):
    pass


class HookedUserBlocks(HookMixin, UserBlocks):
    pass


@pytest.mark.parametrize("cls", [HookedLlama, HookedUserBlocks], ids=["llama", "user"])
def test_user_optimizer_hooks(cls: type) -> None:
    """An overridden optimizer_step still drives the update (its lr warm-up is honoured), and
    on_before_optimizer_step sees every parameter's gradient as a host tensor equal to native's."""
    ref, got = run_parity(cls, max_steps=6)
    assert ref.module.optimizer_step_calls == 6
    assert got.module.optimizer_step_calls == 6, "the user's optimizer_step override was not called"
    assert len(got.module.seen_grads) == 6, "on_before_optimizer_step did not run once per step"
    n_params = len(list(ref.module.parameters()))
    for step, (r, g) in enumerate(zip(ref.module.seen_grads, got.module.seen_grads)):
        assert len(r) == n_params
        assert set(g) == set(r), f"step {step}: gradients missing in on_before_optimizer_step: {sorted(set(r) - set(g))[:5]}"
        for name, grad in g.items():
            assert grad.device.type == "cpu", f"step {step}: {name}.grad is on {grad.device}, expected a host tensor"
            d = rel_diff(r[name], grad)
            assert d <= 1e-5, f"step {step}: {name}.grad differs from native by {d:.2e} (||delta||/||ref||)"
        norm_r = torch.stack([t.double().norm() for t in r.values()]).norm()
        norm_g = torch.stack([t.double().norm() for t in g.values()]).norm()
        assert abs(float(norm_g - norm_r)) <= 1e-5 * float(norm_r)


# ---------------------------------------------------------------------------------------------
# finding the blocks
# ---------------------------------------------------------------------------------------------
def test_no_repeated_blocks_is_a_clear_error() -> None:
    """A module without repeated blocks is refused, and the message says to pass block_class."""
    with pytest.raises(Exception, match="block_class"):
        fit(LinearOnly, "megatrain", max_steps=2)


@pytest.mark.parametrize(
    "block_class, slots", [("ResidualMLPBlock", 2), (ResidualMLPBlock, 3)], ids=["by-name", "by-type-3-slots"]
)
def test_named_block_class(block_class: Any, slots: int) -> None:
    """MegaTrainStrategy(block_class=...) naming the user's block class (a string or the type)."""
    run_parity(UserBlocks, megatrain(block_class=block_class, slots=slots), max_steps=6)


def test_unknown_block_class_is_a_clear_error() -> None:
    with pytest.raises(Exception, match="NoSuchBlock"):
        fit(UserBlocks, megatrain(block_class="NoSuchBlock"), max_steps=2)
