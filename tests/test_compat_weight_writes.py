"""Weights written in place during a step, as the default strategy lets a module do.

``nn.Embedding(max_norm=...)`` renormalises the rows it looks up in its forward, in the weight itself; a
training step may clamp a parameter under ``no_grad`` before its forward (CLIP's ``logit_scale``). Under
the strategy the weights a step sees are device copies: the resident part's for the whole step, a streamed
block's for one call. A resident write goes home with the step's gradients (exact); a block's cannot (its copy
lives for one call, and the backward's recompute would write again): refused in the first forward, naming the
parameter, before any update. Both used to train silently wrong (1.2e-2 relative loss, 2.5 relative weights).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compat_zoo import DIM, VOCAB, MLPBlock, TokenBlocks, assert_exact, refused_in_the_first_forward
from conftest import fit

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class MaxNormEmbedding(TokenBlocks):
    """The input embedding (resident) renormalises the rows each batch looks up to norm <= 1."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, max_norm=1.0)


class ClampedScale(TokenBlocks):
    """A learnt logit scale (resident) clamped in place at the start of every training step, as CLIP does."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (x,) = batch
        y = (7 * x + 3) % VOCAB
        logits = self.head(self.trunk(x)) * self.scale
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with torch.no_grad():
            self.scale.clamp_(0.0, 1.0 + 0.1 * self.global_step)  # moves the value in some steps, not all
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("factory", [MaxNormEmbedding, ClampedScale], ids=["max_norm-embedding", "clamp-in-step"])
def test_a_resident_weight_written_in_place_during_the_step_trains_exactly(factory: Any) -> None:
    ref = fit(factory, None, max_steps=6)
    got = fit(factory, "megatrain", max_steps=6)
    assert_exact(ref, got)


def test_a_resident_write_that_cannot_go_home_exactly_is_refused_before_any_update() -> None:
    """host_state='compact' keeps the masters as bf16 halves: the fp32 write cannot go into them exactly."""
    refused_in_the_first_forward(MaxNormEmbedding, r"cannot train embed\.weight exactly: this step wrote it in place",
                                 host_state="compact")


class MaxNormInBlock(MLPBlock):
    """A position embedding with max_norm inside each block."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(16, DIM, max_norm=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[:2])
        return super().forward(x + self.pos(positions))


class ClampInBlock(MLPBlock):
    """Clamps its first layer's weight in place in its forward (weight clipping done in the forward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc1.weight.clamp_(-0.1, 0.1)
        return super().forward(x)


class MaxNormBlocks(TokenBlocks):
    block_cls = MaxNormInBlock


class ClampBlocks(TokenBlocks):
    block_cls = ClampInBlock


@pytest.mark.parametrize("factory, block, name", [(MaxNormBlocks, "MaxNormInBlock", "pos.weight"),
                                                  (ClampBlocks, "ClampInBlock", "fc1.weight")],
                         ids=["max_norm-embedding", "clamp"])
def test_a_block_writing_its_weights_in_its_forward_is_refused_naming_the_parameter(factory: Any, block: str,
                                                                                     name: str) -> None:
    refused_in_the_first_forward(factory, rf"\({block}\) exactly: its forward writes its parameter {name} in place")
