"""Issue 13, case 6: the user's own activation checkpointing, around or inside the streamed blocks.

MegaTrainStrategy recomputes every block in its backward already; a model that checkpoints too must
still train exactly like the default strategy, and its checkpointing flag must read as the user set it
after ``fit``. Three shapes of it:

* timm's ``set_grad_checkpointing(True)``: the ViT's ``forward_features`` runs ``checkpoint_seq(self.blocks,
  x)``, one non-reentrant ``torch.utils.checkpoint`` region per block, called from *outside* the blocks
  (tests/test_compat_timm.py: ViT, ConvNeXt and Swin; ``test_checkpoint_around_each_block`` here is the same
  pattern in plain torch, also reentrant);
* ``torch.utils.checkpoint`` *inside* a block's forward;
* Hugging Face ``gradient_checkpointing_enable()`` (``GradientCheckpointingLayer``: each decoder layer
  checkpoints its own call).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from compat_zoo import CausalLMModule, EngineProbe, MLPBlock, TokenBlocks, assert_blocks_streamed, assert_exact
from conftest import fit

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class CheckpointedCalls(TokenBlocks):
    """The root calls each block through ``torch.utils.checkpoint.checkpoint`` (timm's checkpoint_seq)."""

    def __init__(self, use_reentrant: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.hparams.use_reentrant)
        return self.norm(h)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_around_each_block(use_reentrant: bool) -> None:
    """Exact, and the blocks stream in the backward too (today: non-reentrant raises CheckpointError in
    the backward; reentrant matches on the CPU only because the recompute runs the blocks as plain host
    modules, their gradients never passing through the engine)."""
    probe = EngineProbe()
    ref = fit(partial(CheckpointedCalls, use_reentrant=use_reentrant), None, max_steps=3)
    got = fit(partial(CheckpointedCalls, use_reentrant=use_reentrant), "megatrain", max_steps=3, callbacks=[probe])
    assert_exact(ref, got)
    assert_blocks_streamed(probe, 3, steps=3)


class InnerCheckpointBlock(MLPBlock):
    """The block checkpoints its own MLP (norm and residual outside the region)."""

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + checkpoint(self._mlp, self.norm(x), use_reentrant=False)


class InnerCheckpointed(TokenBlocks):
    block_cls = InnerCheckpointBlock


def test_checkpoint_inside_each_block() -> None:
    probe = EngineProbe()
    ref = fit(InnerCheckpointed, None, max_steps=3)
    got = fit(InnerCheckpointed, "megatrain", max_steps=3, callbacks=[probe])
    assert_exact(ref, got)
    assert_blocks_streamed(probe, 3, steps=3)


class CheckpointedLlama(CausalLMModule):
    def build(self) -> nn.Module:
        model = super().build()
        model.gradient_checkpointing_enable()
        return model


def test_hf_gradient_checkpointing_enable() -> None:
    """Hugging Face gradient_checkpointing_enable(): trains exactly, and every decoder layer's
    ``gradient_checkpointing`` is still True after fit (today the strategy sets it False at setup and
    leaves it so)."""
    probe = EngineProbe()
    ref = fit(CheckpointedLlama, None, max_steps=3)
    got = fit(CheckpointedLlama, "megatrain", max_steps=3, callbacks=[probe])
    assert all(layer.gradient_checkpointing for layer in ref.module.model.model.layers)
    assert_exact(ref, got)
    assert_blocks_streamed(probe, 2, steps=3)
    flags = [layer.gradient_checkpointing for layer in got.module.model.model.layers]
    assert all(flags), f"the user's gradient checkpointing was switched off by fit: {flags}"
