"""Weights written in place during a step, as the default strategy lets a module do.

``nn.Embedding(max_norm=...)`` renormalises the rows it looks up in its forward, in the weight itself; a
training step may clamp a parameter under ``no_grad`` before its forward (CLIP's ``logit_scale``). Under
the strategy the weights a step sees are device copies: the resident part's for the whole step, a streamed
block's for one call. A resident write goes home with the step's gradients (exact); a block's cannot (its copy
lives for one call, and the backward's recompute would write again): refused in the first forward, naming the
parameter, before any update. Both used to train silently wrong (1.2e-2 relative loss, 2.5 relative weights).
Between steps, a parameter pointed at memory something else keeps (``p.data = t``: ModelPruning's lottery-ticket
reset) would share it under the default strategy; the host store cannot: refused by name. A resident weight replaced
through ``.data`` during the step (peft's CPT) goes home as a write in place does; a block's is refused as one.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelPruning
from torch import nn

from compat_zoo import (DIM, VOCAB, CausalLMModule, MLPBlock, TokenBlocks, assert_exact, build_causal_lm,
                        frozen_names, refused_in_the_first_forward)
from conftest import fit, rel_diff

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


class ProjectedEmbedding(TokenBlocks):
    """The input embedding (resident) projected onto the unit ball through ``.data`` before each lookup, as peft's CPT
    projects its delta embedding in every forward (a write no version counter sees: it was dropped)."""

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        w = self.embed.weight.detach()
        self.embed.weight.data = w / w.norm(dim=1, keepdim=True).clamp(min=1.0)
        return super().trunk(x)


@pytest.mark.parametrize("factory", [MaxNormEmbedding, ClampedScale, ProjectedEmbedding],
                         ids=["max_norm-embedding", "clamp-in-step", "projected-through-data"])
def test_a_resident_weight_written_in_place_during_the_step_trains_exactly(factory: Any) -> None:
    ref = fit(factory, None, max_steps=6)
    got = fit(factory, "megatrain", max_steps=6)
    assert_exact(ref, got)


class CptLM(CausalLMModule):
    """peft's CPT on a tiny Llama: its prompt encoder (resident) projects ``delta_embedding`` through ``.data`` in
    every forward (the sweep of peft 0.22, 2026-12-07: its row norms ended at 0.045 against the default's 0.027)."""

    def build(self) -> nn.Module:
        import peft

        config = peft.CPTConfig(task_type="CAUSAL_LM", cpt_token_ids=[5, 6, 7, 8], cpt_mask=[1, 1, 1, 1],
                                cpt_tokens_type_mask=[1, 2, 2, 4], opt_projection_epsilon=0.1,
                                opt_projection_format_epsilon=0.1)
        return peft.get_peft_model(build_causal_lm("llama"), config)


def test_peft_cpt_projecting_its_prompt_in_every_forward_trains_exactly() -> None:
    pytest.importorskip("peft")
    ref = fit(CptLM, None, max_steps=3)
    got = fit(CptLM, "megatrain", max_steps=3)
    assert_exact(ref, got, frozen=frozen_names(ref.module))


class GrownEmbedding(TokenBlocks):
    """The input embedding given one more row through ``.data`` in its first forward (the default strategy trains
    the grown table from then on)."""

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        w = self.embed.weight.detach()
        if w.shape[0] == VOCAB:
            self.embed.weight.data = torch.cat([w, w[:1]])
        return super().trunk(x)


def test_a_resident_write_that_cannot_go_home_exactly_is_refused_before_any_update() -> None:
    """host_state='compact' keeps the masters as bf16 halves: the fp32 write cannot go into them exactly. A
    weight replaced through .data by one of another shape cannot go into its place in the host store at all."""
    refused_in_the_first_forward(MaxNormEmbedding, r"cannot train embed\.weight exactly: this step wrote it in place",
                                 host_state="compact")
    refused_in_the_first_forward(GrownEmbedding, r"cannot train embed\.weight exactly: this step replaced it through "
                                 r"\.data with a tensor of shape \(97, 32\), not its \(96, 32\)")


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


class ProjectInBlock(MLPBlock):
    """Assigns its first layer's weight a clipped copy through ``.data`` in its forward (trained silently wrong: 2.0e-02
    relative in the loss after 5 steps)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fc1.weight.data = self.fc1.weight.detach().clamp(-0.1, 0.1)
        return super().forward(x)


class MaxNormBlocks(TokenBlocks):
    block_cls = MaxNormInBlock


class ProjectBlocks(TokenBlocks):
    block_cls = ProjectInBlock


class ClampBlocks(TokenBlocks):
    block_cls = ClampInBlock


@pytest.mark.parametrize("factory, block, name", [(MaxNormBlocks, "MaxNormInBlock", "pos.weight"),
                                                  (ClampBlocks, "ClampInBlock", "fc1.weight"),
                                                  (ProjectBlocks, "ProjectInBlock", "fc1.weight")],
                         ids=["max_norm-embedding", "clamp", "projected-through-data"])
def test_a_block_writing_its_weights_in_its_forward_is_refused_naming_the_parameter(factory: Any, block: str,
                                                                                     name: str) -> None:
    refused_in_the_first_forward(factory, rf"\({block}\) exactly: its forward writes its parameter {name} in place")


class HeadPruning(ModelPruning):
    """Lightning's ModelPruning on the LM head (resident), with its default lottery-ticket reset: at each epoch's
    end ``weight_orig.data = original.data``, the copy of the first weights it keeps."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._parameters_to_prune = [(pl_module.head, "weight")]
        super().setup(trainer, pl_module, stage)


def test_a_parameter_pointed_at_memory_kept_elsewhere_is_refused_and_the_step_before_stays_whole() -> None:
    """Under the default strategy the head then shares memory with the callback's copy and trains it too (its next
    reset changes nothing); the host store cannot alias it: trained silently apart from epoch 2 (2e-2 relative
    loss, 0.28 in the head). Refused before the next step, naming the parameter and the fix; the weights are the
    default strategy's after the epoch, and the refusal does not read as a torn step."""
    ref = fit(TokenBlocks, None, callbacks=[HeadPruning("l1_unstructured", amount=0.3)], max_epochs=1, max_steps=-1)
    built: list[pl.LightningModule] = []

    def build() -> pl.LightningModule:
        built.append(TokenBlocks())
        return built[-1]

    with pytest.raises(ValueError, match=r"head\.weight_orig.*use_lottery_ticket_hypothesis=False") as err:
        fit(build, "megatrain", callbacks=[HeadPruning("l1_unstructured", amount=0.3)], max_epochs=3, max_steps=-1)
    assert not any("mix two steps" in n for n in getattr(err.value, "__notes__", [])), err.value.__notes__
    got = {k: v.detach().cpu() for k, v in built[0].state_dict().items()}
    got["head.weight"] = got.pop("head.weight_orig") * got.pop("head.weight_mask")
    assert sorted(got) == sorted(ref.state)
    worst = max(rel_diff(ref.state[k], got[k]) for k in ref.state if ref.state[k].is_floating_point())
    assert worst <= 1e-5, worst
