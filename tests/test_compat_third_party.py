"""Third-party model code the other compat tests do not cover: litgpt's ``GPT`` (and its LoRA variant)
and Lightning's own demo modules.

Each test trains one module with Lightning's default strategy and with ``strategy="megatrain"`` (CPU,
fp32, same seed and data, 3 steps) and accepts what the compatibility issue accepts: the same result
(every loss and every final ``state_dict`` tensor within 1e-5, frozen tensors bit for bit untouched), or a
refusal before the first training step whose message names the module. Where the model has repeated
blocks, the test also checks which blocks megatrain found (``EngineProbe``) and that they really streamed
(their gradients came home through the engine every step), so that a model silently run as one resident
module does not pass.

* litgpt: ``litgpt.GPT`` from tiny configs of four families (Llama, Pythia/GPT-NeoX, Mixtral's mixture of
  experts, Gemma 2), and ``litgpt.lora.GPT`` with ``mark_only_lora_as_trainable``. Its blocks are
  ``transformer.h``, a plain ``nn.ModuleList`` called from the root with (x, cos, sin, mask, ...), where
  cos and sin are non-persistent buffers of the root. litgpt is not in the ``test`` extra: every release pins
  ``huggingface-hub`` below the 2.x that transformers 5.x needs (0.5.13: ``<1.4``), and an exact
  ``psutil``, so installing it would downgrade transformers. The litgpt tests skip without it; it imports
  and runs with ``pip install --no-deps litgpt`` (its model code needs none of its dependencies that the
  test extra does not already bring).
* ``lightning.pytorch.demos``: ``LightningTransformer`` (an ``nn.Transformer`` encoder-decoder with a
  lazily built positional table held in a plain attribute, dropout 0.2, SGD), fed random tokens instead of
  WikiText2 (which downloads); ``BoringModel`` (one ``nn.Linear``, no repeated blocks: megatrain must
  refuse it by name); ``LightningLSTM`` (one ``nn.LSTM``, no repeated blocks either).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from compat_zoo import EngineProbe, assert_blocks_streamed, assert_exact, frozen_names, parity_or_refusal
from conftest import assert_is_megatrain, fit
from zoo import ZooModule, random_tokens

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

STEPS = 3
LITGPT_VOCAB = 128


# ---------------------------------------------------------------------------------------------
# litgpt
# ---------------------------------------------------------------------------------------------
# litgpt's own table of named configs (``Config.from_name``: no download), shrunk to 2 layers of width 32,
# 4 heads, vocabulary 128, block size 64; each family adds the overrides its shape needs.
LITGPT_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # RMSNorm, rotary, grouped queries (2 groups), SwiGLU MLP
    "llama": ("tiny-llama-1.1b", dict(n_query_groups=2, intermediate_size=64)),
    # GPT-NeoX: LayerNorm, partial rotary, parallel residual, GELU MLP, biases
    "pythia": ("pythia-14m", dict(intermediate_size=128)),
    # mixture of experts: LLaMAMoE routes each token to 2 of 4 experts with Python-level indexing
    "mixtral": ("Mixtral-8x7B-v0.1", dict(n_query_groups=2, intermediate_size=64, moe_intermediate_size=64, n_expert=4,
                                          n_expert_per_token=2)),
    # Gemma 2: scaled embeddings, attention and final logit soft-capping, post-attention / post-MLP norms,
    # sliding-window attention (window 8 < sequence 16) on every other layer
    "gemma2": ("Gemma-2-2b", dict(n_query_groups=2, head_size=8, intermediate_size=64, sliding_window_size=8)),
}


def litgpt_config(family: str, lora: bool = False) -> Any:
    """A tiny ``litgpt.Config`` (``litgpt.lora.Config`` with LoRA r=4 on query, value and MLP)."""
    if lora:
        from litgpt.lora import Config
    else:
        from litgpt import Config

    name, overrides = LITGPT_FAMILIES[family]
    shape: dict[str, Any] = dict(
        n_layer=2, n_embd=32, n_head=4, block_size=64, vocab_size=LITGPT_VOCAB, padded_vocab_size=LITGPT_VOCAB, **overrides
    )
    if lora:
        shape.update(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True, lora_value=True, lora_mlp=True)
    return Config.from_name(name, **shape)


class LitGPTModule(ZooModule):
    """litgpt's ``GPT`` (or ``litgpt.lora.GPT`` with only the LoRA matrices trainable) on random tokens,
    next-token cross-entropy; 12 rows of 16 tokens in batches of 4, AdamW (fused, eps 1e-6) over the
    parameters that require grad."""

    def __init__(self, family: str = "llama", lora: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("n_train", 12)
        kwargs.setdefault("scheduler", False)
        super().__init__(**kwargs)
        config = litgpt_config(family, lora)
        if lora:
            from litgpt.lora import GPT, mark_only_lora_as_trainable

            self.model = GPT(config)
            mark_only_lora_as_trainable(self.model)
        else:
            from litgpt import GPT

            self.model = GPT(config)

    def make_data(self, n: int, seq_len: int, seed: int) -> torch.Tensor:
        return random_tokens(n, seq_len, LITGPT_VOCAB, seed)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (x,) = batch
        logits = self.model(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


@pytest.mark.parametrize("family", list(LITGPT_FAMILIES))
def test_litgpt_gpt_parity(family: str) -> None:
    """litgpt's GPT in four families (see LITGPT_FAMILIES): megatrain streams the two ``transformer.h``
    blocks (called from the root with its rotary and mask buffers) and trains exactly like the default
    strategy."""
    pytest.importorskip("litgpt")
    probe = EngineProbe()
    factory = partial(LitGPTModule, family=family)
    ref = fit(factory, None, max_steps=STEPS)
    got = fit(factory, "megatrain", max_steps=STEPS, callbacks=[probe])
    assert_is_megatrain(got)
    assert probe.block_classes == ["Block", "Block"], probe.block_classes
    assert_exact(ref, got)
    assert_blocks_streamed(probe, 2, steps=STEPS)


@pytest.mark.parametrize("family", list(LITGPT_FAMILIES))
def test_litgpt_lora_parity(family: str) -> None:
    """litgpt's LoRA GPT after ``mark_only_lora_as_trainable`` (LoRA on query, value and MLP; every base
    weight frozen, inside the blocks and out): same losses and adapters as the default strategy, base
    weights bit for bit untouched, the blocks streamed."""
    pytest.importorskip("litgpt")
    probe = EngineProbe()
    factory = partial(LitGPTModule, family=family, lora=True)
    ref = fit(factory, None, max_steps=STEPS)
    frozen = frozen_names(ref.module)
    base = {name for name, _ in ref.module.named_parameters() if "lora_" not in name}
    assert frozen == base, f"LoRA should freeze exactly the base weights; trainable: {sorted(base - frozen)[:4]}"
    got = fit(factory, "megatrain", max_steps=STEPS, callbacks=[probe])
    assert_is_megatrain(got)
    assert probe.block_classes == ["Block", "Block"], probe.block_classes
    assert_exact(ref, got, frozen=frozen)
    assert_blocks_streamed(probe, 2, steps=STEPS)


# ---------------------------------------------------------------------------------------------
# lightning.pytorch.demos
# ---------------------------------------------------------------------------------------------
DEMO_VOCAB = 64


class RandomTokens:
    """Mixin for the demos that read WikiText2 (which downloads): their (inputs, targets) batches from
    random tokens instead (targets = inputs shifted by one), and a ``prepare_data`` that downloads nothing."""

    def prepare_data(self) -> None:
        pass

    def train_dataloader(self) -> DataLoader:
        tokens = random_tokens(8, 17, DEMO_VOCAB, 1234)
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2, shuffle=False)


def lightning_transformer() -> Any:
    from lightning.pytorch.demos import LightningTransformer

    class RandomLightningTransformer(RandomTokens, LightningTransformer):
        pass

    return RandomLightningTransformer(vocab_size=DEMO_VOCAB)


def lightning_lstm() -> Any:
    from lightning.pytorch.demos import LightningLSTM

    class RandomLightningLSTM(RandomTokens, LightningLSTM):
        pass

    return RandomLightningLSTM(vocab_size=DEMO_VOCAB)


# LightningTransformer scales its embeddings by sqrt(200) ~ 14 before the first layers, so their
# self-attention logits are large and the softmax nearly saturated: the gradients of the first layers' query
# and key projections amplify fp32 rounding. Measured (3 steps, CPU): the default strategy in fp32 ends
# 1.1e-4 (decoder in_proj_weight) and 1.4e-3 (decoder in_proj_bias, zero at init, so its norm is 3 steps of
# updates) in ||delta||/||ref|| from the same run in fp64; megatrain ends 2.2e-5 and 2.8e-4 from the fp32
# run, i.e. closer to it than the fp32 run is to the exact result. Every other tensor, and every loss,
# within 1e-5. A real defect (a missed or doubled update) moves these tensors by O(1) relative.
TRANSFORMER_ROUNDING = {"layers.0.self_attn.in_proj": 5e-3}


def test_lightning_demo_transformer() -> None:
    """``LightningTransformer`` as shipped (nn.Transformer, 2 encoder and 2 decoder layers, width 200,
    dropout 0.2, SGD lr 0.1): megatrain streams both layer lists (``TransformerEncoderLayer`` x2, then
    ``TransformerDecoderLayer`` x2) and trains like the default strategy (the first layers' query/key
    projections within their fp32 rounding spread, see TRANSFORMER_ROUNDING). A refusal naming the model
    would be an accepted outcome for an unknown model, but not here: nn.Transformer is supported."""
    probe = EngineProbe()
    compare = partial(assert_exact, loose=TRANSFORMER_ROUNDING)
    ref, got, err = parity_or_refusal(
        lightning_transformer, ["Transformer"], compare=compare, callbacks=lambda: [probe], max_steps=STEPS
    )
    assert err is None, f"megatrain refused LightningTransformer: {err}"
    assert probe.block_classes == ["TransformerEncoderLayer"] * 2 + ["TransformerDecoderLayer"] * 2, probe.block_classes
    assert_blocks_streamed(probe, 4, steps=STEPS)


def test_lightning_demo_boring_model_refused_by_name() -> None:
    """``BoringModel`` (one nn.Linear, SGD and a StepLR, random data of its own): nothing repeats, so
    megatrain has nothing to stream; it must refuse before the first step naming the model and pointing at
    Lightning's default strategy, which trains it."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    ref, got, err = parity_or_refusal(BoringModel, ["BoringModel", "default strategy"], max_steps=STEPS)
    assert err is not None, "megatrain trained a model with no repeated blocks"
    assert ref.trainer.global_step == STEPS


def test_lightning_demo_lstm_refused_by_name() -> None:
    """``LightningLSTM`` (embedding, one 4-layer nn.LSTM, linear head; it carries its hidden state across
    steps): its layers live inside one nn.LSTM, so there are no repeated blocks to stream; refused before the
    first step with a message naming the model (here its subclass ``RandomLightningLSTM``) and pointing at
    the default strategy."""
    ref, got, err = parity_or_refusal(lightning_lstm, ["LightningLSTM", "default strategy"], max_steps=STEPS)
    assert err is not None, "megatrain trained a model with no repeated blocks"
    assert ref.trainer.global_step == STEPS
