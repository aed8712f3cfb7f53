"""Liger Kernel applied by the user's module (skipped where liger_kernel is not installed: it needs triton).

Its fused RMSNorm, SwiGLU and rotary kernels write in place where torch's selective recompute cannot see it
(on the H200 the gradients of a 7B layer came out 1.44 relative away: recipes/results/2026-12-04-h200-session14.md),
so the strategy finds them at setup, by name: ``kept_saves="matmuls"`` set by hand is refused; left open, kept
blocks keep every activation and the blocks stay eager. Its fused linear cross-entropy alone (the *ForCausalLM's
forward, outside the blocks) changes nothing. Setup only: Liger's kernels run on a GPU
(tests/test_compiled_blocks_cuda.py (c) trains with them).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from conftest import megatrain
from megatrain_lightning.errors import ConfigError
from megatrain_lightning.setup_checks import unseen_in_place_kernels

pytest.importorskip("liger_kernel.transformers")


@pytest.fixture
def qwen2_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    from transformers.models.qwen2 import modeling_qwen2

    for name in ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP"):  # Liger patches transformers' module itself
        monkeypatch.setattr(modeling_qwen2, name, getattr(modeling_qwen2, name))

    def build(**liger: bool) -> pl.LightningModule:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2
        from transformers import Qwen2Config, Qwen2ForCausalLM

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128)
                self.model = Qwen2ForCausalLM(config)
                apply_liger_kernel_to_qwen2(model=self.model, **liger)

            def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
                return self.model(input_ids=batch, labels=batch).loss

            def configure_optimizers(self) -> Any:
                return torch.optim.AdamW(self.parameters())

        return Module()

    return build


def _setup_only(module: pl.LightningModule, strategy: Any) -> Any:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy(), max_steps=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(torch.randint(0, 128, (4, 8)), batch_size=2))
    return trainer.strategy


def test_liger_block_kernels_are_found_and_keep_whole_activations(qwen2_module: Any) -> None:
    module = qwen2_module()
    found = unseen_in_place_kernels(module)
    assert found is not None and "Qwen2RMSNorm" in found and "Qwen2MLP" in found and "apply_rotary_pos_emb" in found
    with pytest.raises(ConfigError, match="kept_saves='matmuls'.*Liger Kernel.*rope=False"):
        _setup_only(module, megatrain(keep_activations=1, kept_saves="matmuls"))
    strategy = _setup_only(qwen2_module(), megatrain(keep_activations=1))
    assert strategy.config.kept_saves == "all" and strategy.config.compile_blocks is False


def test_liger_fused_linear_cross_entropy_alone_changes_nothing(qwen2_module: Any) -> None:
    module = qwen2_module(rope=False, rms_norm=False, swiglu=False, fused_linear_cross_entropy=True)
    assert unseen_in_place_kernels(module) is None
    strategy = _setup_only(module, megatrain(keep_activations=1, kept_saves="matmuls"))
    assert strategy.config.kept_saves == "matmuls" and strategy.config.compile_blocks is None
