"""What a streamed block's forward depends on beyond its inputs and weights, as its recompute in the backward
must see it: Python's and numpy's RNGs, a ``torch.Generator`` of its own, a counter it keeps, the ``training``
flags of a pass in eval mode inside a training step, peft's active adapter switched between two forwards of one
step, buffers the user replaces or changes between steps.
Each trains exactly as under Lightning's default strategy. What cannot: a tensor with a gradient history
hidden in an argument that torch's pytree does not flatten (refused in the first forward, naming it and the
fix), ``torch.utils.checkpoint(use_reentrant=True)`` inside a block (refused naming the block and the fix), a
gradient taken through the blocks with ``create_graph=True`` and a block input changed in place after its forward
(both refused in the first step, before any update). Also: ``nn.TransformerEncoder``'s nested-tensor path in
validation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import partial
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from compat_zoo import (DIM, CausalLMModule, EngineProbe, MLPBlock, TokenBlocks, assert_blocks_streamed, assert_exact,
                        build_causal_lm, compare_losses, refused_in_the_first_forward)
from conftest import fit, megatrain

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class PythonRandomBlock(MLPBlock):
    """Stochastic depth drawn with Python's ``random``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = not self.training or random.random() > 0.4
        return super().forward(x) if keep else x


class NumpyScaleBlock(MLPBlock):
    """Its branch scaled by a numpy draw."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = float(np.random.uniform(0.5, 1.5)) if self.training else 1.0
        return x + scale * (super().forward(x) - x)


class OwnGeneratorBlock(MLPBlock):
    """Noise from a generator of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(x.shape, generator=self.gen) if self.training else 0.0
        return super().forward(x + 0.1 * noise)


class CounterBlock(MLPBlock):
    """A schedule read from a call counter the forward increments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        scale = 1.0 if self.calls % 2 else 2.0
        return x + scale * (super().forward(x) - x)


class DropoutBlock(MLPBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.norm(x)))), 0.3, self.training)


class EvalPassInTraining(TokenBlocks):
    """A consistency term: the blocks in train mode (dropout) and again in eval mode, both with grad."""

    block_cls = DropoutBlock

    def compute_loss(self, batch: Any) -> torch.Tensor:
        loss = super().compute_loss(batch)
        (x,) = batch
        self.eval()
        clean = self.trunk(x)
        self.train()
        return loss + 0.1 * clean.square().mean()


@pytest.mark.parametrize("block_cls", [PythonRandomBlock, NumpyScaleBlock, OwnGeneratorBlock, CounterBlock],
                         ids=["python-random", "numpy", "own-generator", "counter"])
@pytest.mark.parametrize("options", [{}, {"keep_activations": 3, "kept_saves": "matmuls"}],
                         ids=["recomputed", "kept-matmuls"])
def test_a_block_drawing_from_other_rngs_or_counting_trains_exactly(block_cls: type, options: dict) -> None:
    """Seeded alike (fit seeds torch; Python's and numpy's RNGs are seeded here): every draw repeats, in a
    recomputed block and in a kept one's selective recompute."""
    factory = type(f"{block_cls.__name__}Model", (TokenBlocks,), {"block_cls": block_cls})
    runs = []
    for strategy in (None, megatrain(**options)):
        random.seed(3)
        np.random.seed(3)
        runs.append(fit(factory, strategy, max_steps=6))
    assert_exact(*runs)


def test_an_eval_mode_pass_with_grad_inside_a_training_step_trains_exactly() -> None:
    assert_exact(fit(EvalPassInTraining, None, max_steps=5), fit(EvalPassInTraining, "megatrain", max_steps=5))


class TwoAdapters(CausalLMModule):
    """Two LoRA adapters trained in one step: each forward through its own (peft's active adapter is a str, or
    a list of them, on every LoRA layer: the recompute must see the one its forward saw)."""

    def build(self) -> nn.Module:
        import peft

        config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        model = peft.get_peft_model(build_causal_lm("llama"), peft.LoraConfig(**config))
        model.add_adapter("b", peft.LoraConfig(**config))
        return model

    def use(self, name: str) -> None:
        self.model.base_model.set_adapter(name)
        for n, p in self.model.named_parameters():
            p.requires_grad_("lora_" in n)  # set_adapter freezes the inactive one: both train here

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for n, p in self.model.named_parameters() if "lora_" in n], lr=3e-3, fused=True)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (x,) = batch
        self.use("default")
        loss = self.model(input_ids=x, labels=x).loss
        self.use("b")
        return loss + self.model(input_ids=x, labels=(7 * x + 3) % 64).loss


def test_peft_adapters_switched_between_two_forwards_of_a_step_train_exactly() -> None:
    pytest.importorskip("peft")
    ref = fit(TwoAdapters, None, max_steps=3)
    got = fit(TwoAdapters, "megatrain", max_steps=3)
    assert_exact(ref, got, frozen=[k for k in ref.init_state if "lora_" not in k])


class GainBlock(MLPBlock):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gain", torch.ones(DIM), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain * (super().forward(x) - x)


class GainModel(TokenBlocks):
    block_cls = GainBlock


class GainSchedule(pl.Callback):
    """Writes each block's ``gain`` buffer before every batch: replaced (``block.gain = new``) or in place."""

    def __init__(self, replace: bool) -> None:
        self.replace = replace

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        value = 1.0 + trainer.global_step
        for block in pl_module.blocks:
            if self.replace:
                block.gain = torch.full((DIM,), value)
            else:
                block.gain.fill_(value)


@pytest.mark.parametrize("replace", [True, False], ids=["replaced", "in-place"])
def test_a_buffer_written_between_steps_is_the_one_the_blocks_use(replace: bool) -> None:
    ref = fit(GainModel, None, max_steps=4, callbacks=[GainSchedule(replace)])
    got = fit(GainModel, "megatrain", max_steps=4, callbacks=[GainSchedule(replace)])
    assert_exact(ref, got)
    assert float(got.module.blocks[0].gain[0]) == 4.0  # the user's last value, not the one captured at setup


@dataclass
class Skip:
    first: torch.Tensor


class SkipBlock(MLPBlock):
    def forward(self, x: torch.Tensor, skip: Skip) -> torch.Tensor:
        return super().forward(x) + 0.5 * skip.first


class SkipModel(TokenBlocks):
    """Block 0's output reaches the later blocks inside a dataclass."""

    block_cls = SkipBlock

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        first = torch.zeros_like(h)
        for i, block in enumerate(self.blocks):
            h = block(h, Skip(first))
            if i == 0:
                first = h
        return self.norm(h)


def test_a_grad_tensor_inside_a_dataclass_argument_is_refused_in_the_first_forward() -> None:
    """The default strategy trains; megatrain refuses in the first batch, every weight as it was built."""
    refused_in_the_first_forward(SkipModel, r"block 1 \(SkipBlock\).*\(Skip\.first\).*register_dataclass")


def test_the_same_dataclass_registered_with_pytree_trains_exactly() -> None:
    from torch.utils import _pytree as pytree

    pytree.register_dataclass(Skip)
    try:
        assert_exact(fit(SkipModel, None, max_steps=4), fit(SkipModel, "megatrain", max_steps=4))
    finally:
        pytree._deregister_pytree_node(Skip)


class Skips(dict):
    """A dict of a class of its own: torch's pytree leaves it whole (as transformers' KVSharingDict)."""


class SkipsBlock(MLPBlock):
    def forward(self, x: torch.Tensor, skips: Skips) -> torch.Tensor:
        return super().forward(x) + 0.5 * skips["first"]


class SkipsModel(TokenBlocks):
    """Block 0's output reaches the later blocks inside a dict subclass."""

    block_cls = SkipsBlock

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        skips = Skips(first=torch.zeros_like(h))
        for i, block in enumerate(self.blocks):
            h = block(h, skips)
            if i == 0:
                skips["first"] = h
        return self.norm(h)


def test_a_grad_tensor_inside_a_dict_subclass_argument_is_refused_in_the_first_forward() -> None:
    """The dict would be a constant of block 1's call, so block 0 would lose the skip's gradient. Before, the refusal
    came from the first call's walk, which found the skip's history reaching embed.weight and named that as a
    parameter read through an attribute: the wrong cause and fix."""
    refused_in_the_first_forward(SkipsModel, r"block 1 \(SkipsBlock\).*\(an item of its Skips\).*plain tuple, list or dict")


class CountingBlock(MLPBlock):
    def forward(self, x: torch.Tensor, counts: dict) -> torch.Tensor:
        counts["calls"] = counts.get("calls", 0) + 1  # what the model reads after the blocks
        return super().forward(x)


class CountingModel(TokenBlocks):
    """The blocks count their calls into a plain dict the model reads after them (a mask computed once and reused
    would come the same way)."""

    block_cls = CountingBlock

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        h, counts = self.embed(x), {}
        for block in self.blocks:
            h = block(h, counts)
        return self.norm(h) * counts.get("calls", 1) / len(self.blocks)


def test_a_block_writing_into_a_plain_dict_it_is_handed_is_refused_in_the_first_forward() -> None:
    """In a step a streamed block is handed torch's pytree's rebuild of a plain dict or list: the model's dict stayed
    empty, so its output was scaled by 1/2 instead of 1, silently (the losses differed from the first step)."""
    refused_in_the_first_forward(CountingModel, r"block 0 \(CountingBlock\).*writes into the argument 1 \(a plain dict or list\).*"
                                 r"a subclass of dict or list is handed as it is")


class ReentrantBlock(MLPBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + checkpoint(lambda h: self.fc2(F.gelu(self.fc1(self.norm(h)))), x, use_reentrant=True)


class ReentrantModel(TokenBlocks):
    block_cls = ReentrantBlock


def test_a_reentrant_checkpoint_inside_a_block_is_refused_naming_the_block_and_the_fix() -> None:
    with pytest.raises(RuntimeError, match=r"block 2 \(ReentrantBlock\).*use_reentrant=True.*Pass use_reentrant=False"):
        fit(ReentrantModel, "megatrain", max_steps=2)


class EncoderModel(TokenBlocks):
    """``nn.TransformerEncoder`` with a padding mask: its fast path nests the input without grad (validation)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        layer = nn.TransformerEncoderLayer(DIM, 4, 2 * DIM, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
        del self.blocks

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        pad = torch.zeros_like(x, dtype=torch.bool)
        pad[:, -3:] = True
        return self.norm(self.encoder(self.embed(x), src_key_padding_mask=pad))


def test_transformer_encoder_nested_fast_path_in_validation_trains_exactly() -> None:
    factory = partial(EncoderModel, n_val=8)
    kw = dict(max_steps=4, limit_val_batches=2, num_sanity_val_steps=2, val_check_interval=2)
    ref = fit(factory, None, **kw)
    probe = EngineProbe()
    got = fit(factory, "megatrain", callbacks=[probe], **kw)
    assert probe.block_classes == ["TransformerEncoderLayer"] * 2
    assert_blocks_streamed(probe, 2, 4)
    assert_exact(ref, got)
    assert ref.module.val_losses
    compare_losses(ref.module.val_losses, got.module.val_losses, what="validation loss")


class GradientPenalty(TokenBlocks):
    """An input-gradient penalty: the gradient of the loss at the embedding output, taken with create_graph."""

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (x,) = batch
        h0 = self.embed(x)
        h = h0
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ((7 * x + 3) % logits.shape[-1]).reshape(-1))
        (g,) = torch.autograd.grad(loss, h0, create_graph=True)
        return loss + 50.0 * g.square().sum()


def test_a_gradient_penalty_through_the_blocks_is_refused_in_the_first_step() -> None:
    """The default strategy trains it (second-order terms reach the weights); a streamed block's backward has no
    graph, so the strategy refuses in the first step, naming the block, before any update."""
    refused_in_the_first_forward(GradientPenalty, r"block 2 \(MLPBlock\) exactly: a gradient is taken through it "
                                                   r"with create_graph=True")


class BiasBlock(MLPBlock):
    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return super().forward(x + bias)  # the add saves neither operand: autograd would not mind a refill


class TwoViews(TokenBlocks):
    """Two passes per step sharing one bias buffer (no grad) refilled in place between them; one backward."""

    block_cls = BiasBlock

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (x,) = batch
        y = (7 * x + 3) % self.head.out_features
        buf = torch.zeros(x.shape[1], DIM)
        total = torch.zeros(())
        for k in range(2):
            buf.copy_(torch.linspace(-1, 1, DIM) * 0.5 * (k + 1))
            h = self.embed(x)
            for block in self.blocks:
                h = block(h, buf)
            logits = self.head(self.norm(h))
            total = total + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        return total


def test_a_block_input_refilled_in_place_after_its_forward_is_refused_in_the_first_step() -> None:
    """The recompute starts from the saved inputs: one changed in place since would be read with its new
    values. Refused in the first step's backward, before any update."""
    refused_in_the_first_forward(TwoViews, r"changed in place after the block's forward")
