"""The sequence-chunked MLP (``models/chunked_mlp.py``, ``CausalLM(mlp_chunk_tokens=...)``).

Exact in fp32: the same losses and weights (1e-5) as the unchunked model, under Lightning's default strategy
and under MegaTrainStrategy's recompute (with offloaded, narrow, kept and matmul-saving blocks); under
bf16-mixed it must run (the backward's recompute replays autocast) and stay within rounding. It must really
bound the intermediates: no MLP activation wider than one chunk is ever made. And the attention the long
context relies on: CausalLM calls SDPA causally with no mask, the call a GPU serves with flash attention.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import assert_parity, compare_losses, fit, megatrain, rel_diff
from megatrain_lightning.errors import ConfigError
from megatrain_lightning.models import CausalLM, chunk_mlp
from zoo import ZOO, TinyLlama

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

CHUNK = 5  # does not divide the 4 x 16 tokens of a zoo batch: the last chunk is short


def chunked(factory: Any, tokens: int | None = CHUNK, fold_norm: bool = True) -> Any:
    def build() -> Any:
        module = factory()
        assert chunk_mlp(module.model, tokens, fold_norm=fold_norm) == module.model.config.num_hidden_layers
        return module
    return build


LLAMA = partial(ZOO["llama"], optimizer="adamw", lr=3e-3, scheduler=True)


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("fold_norm", [True, False])
@pytest.mark.parametrize("tokens", [1, CHUNK, 64, 1000])
def test_chunked_equals_unchunked_fp32(tokens: int, fold_norm: bool) -> None:
    torch.manual_seed(0)
    model = TinyLlama().model
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    ref_loss, ref = _loss_and_grads(model, ids)
    chunk_mlp(model, tokens, fold_norm=fold_norm)
    layer = model.model.layers[0]
    assert ("forward" in layer.post_attention_layernorm.__dict__) == fold_norm
    loss, got = _loss_and_grads(model, ids)
    assert abs(float(loss - ref_loss)) <= 1e-6 * abs(float(ref_loss))
    assert max(rel_diff(ref[k], got[k]) for k in ref) <= 1e-6
    if tokens >= 64:  # a sequence within one chunk runs the MLP as it is: bit for bit
        assert torch.equal(loss, ref_loss) and all(torch.equal(ref[k], got[k]) for k in ref)
    chunk_mlp(model, None)  # and back
    assert "forward" not in layer.mlp.__dict__ and "forward" not in layer.post_attention_layernorm.__dict__
    assert torch.equal(_loss_and_grads(model, ids)[0], ref_loss)


def test_the_norm_joins_the_chunks_only_where_its_output_goes_to_the_mlp_alone() -> None:
    """Llama and Qwen2 layers feed post_attention_layernorm straight into the MLP; Gemma2 adds the residual
    and a second norm between them, GPT-OSS's MLP returns router scores too."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from megatrain_lightning.models.chunked_mlp import folded_norm

    assert folded_norm(TinyLlama().model.model.layers[0]) is not None
    assert folded_norm(ZOO["qwen2"]().model.model.layers[0]) is not None
    assert folded_norm(ZOO["gpt_oss"]().model.model.layers[0]) is None
    gemma = Gemma2ForCausalLM(Gemma2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=1, head_dim=8,
                                           num_attention_heads=2, num_key_value_heads=1, vocab_size=16))
    assert folded_norm(gemma.model.layers[0]) is None


def test_parity_chunked_against_unchunked_default_strategy() -> None:
    ref = fit(LLAMA, None, max_steps=5)
    got = fit(chunked(LLAMA), None, max_steps=5)
    assert_parity(ref, got)


@pytest.mark.parametrize("option", [
    dict(),
    dict(fold_norm=False),
    dict(offload_inputs=1),
    dict(offload_inputs=True, saved_inputs_dtype="compute"),  # fp32 compute: narrowing is a no-op
    dict(keep_activations=1),
    dict(keep_activations=1, kept_saves="matmuls"),
])
def test_parity_chunked_megatrain_against_unchunked_default(option: dict) -> None:
    option = dict(option)
    fold = option.pop("fold_norm", True)
    ref = fit(LLAMA, None, max_steps=5)
    got = fit(chunked(LLAMA, fold_norm=fold), megatrain(**option), max_steps=5)
    assert_parity(ref, got)


def test_bf16_mixed_megatrain_replays_autocast_in_the_chunk_recompute() -> None:
    """The slots hold bf16 weights: a chunk recomputed outside autocast would fail (fp32 x bf16 matmul)."""
    ref = fit(LLAMA, megatrain(), precision="bf16-mixed", max_steps=4)
    got = fit(chunked(LLAMA), megatrain(), precision="bf16-mixed", max_steps=4)
    compare_losses(ref.losses, got.losses, rtol=2e-2)


class _WidestMLPActivation(TorchDispatchMode):
    """The most rows of any 3-d tensor whose last dimension is the MLP's intermediate size."""

    def __init__(self, intermediate: int) -> None:
        super().__init__()
        self.intermediate, self.rows = intermediate, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[-1] == self.intermediate:
                self.rows = max(self.rows, t.shape[0] * t.shape[1])
        return out


class _Watch(L.Callback):
    megatrain_reads_weights = False

    def __init__(self, intermediate: int) -> None:
        self.mode = _WidestMLPActivation(intermediate)

    def on_train_batch_start(self, *args: Any) -> None:
        self.mode.__enter__()

    def on_train_batch_end(self, *args: Any) -> None:  # after the backward (automatic optimisation)
        self.mode.__exit__(None, None, None)


@pytest.mark.parametrize("strategy", [None, "megatrain"])
def test_no_mlp_activation_wider_than_a_chunk(strategy: str | None) -> None:
    """Forward, recompute and backward: the intermediates never hold more than one chunk of rows (the
    unchunked model holds all 64 tokens' at once)."""
    seen = {}
    for tokens in (None, CHUNK):
        watch = _Watch(intermediate=64)  # TinyLlama's intermediate_size
        factory = chunked(LLAMA, tokens) if tokens else LLAMA
        fit(factory, megatrain() if strategy else None, max_steps=1, callbacks=[watch])
        seen[tokens] = watch.mode.rows
    assert seen == {None: 64, CHUNK: CHUNK}


def test_refusals() -> None:
    with pytest.raises(ConfigError, match="mlp_chunk_tokens=0"):
        chunk_mlp(TinyLlama().model, 0)
    with pytest.raises(ConfigError, match="no `mlp` submodule"):
        chunk_mlp(ZOO["encoder"](), 4)
    moe = ZOO["gpt_oss"]()
    chunk_mlp(moe.model, 4)
    ids = torch.randint(0, 96, (2, 24))
    with pytest.raises(ConfigError, match="mixture of experts"):
        moe.model(input_ids=ids, labels=ids)


def test_causal_lm_chunks_and_calls_sdpa_causally_without_a_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU needs for a memory-linear attention kernel: SDPA (flash / cuDNN) with is_causal and no
    explicit mask (a mask would send it to the math kernel, T x T scores)."""
    config = dict(model_type="llama", vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    module = CausalLM(config=config, mlp_chunk_tokens=8, loss_chunk_tokens=16)
    module.configure_model()
    assert module.model.config._attn_implementation == "sdpa"
    assert all("forward" in layer.mlp.__dict__ for layer in module.model.model.layers)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):  # noqa: ANN001
        calls.append((attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ids = torch.randint(0, 259, (2, 40))
    module.causal_lm_loss(ids, ids).backward()
    assert calls == [(True, True)] * 2


def test_a_deep_copy_chunks_its_own_weights() -> None:
    """copy.deepcopy (EMA and SWA callbacks, say) must give a model whose chunked MLP reads the copy's weights."""
    import copy

    torch.manual_seed(0)
    model = TinyLlama().model
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    chunk_mlp(model, CHUNK)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    got = twin(input_ids=ids).logits
    chunk_mlp(twin, None)
    assert torch.allclose(got, twin(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, model(input_ids=ids).logits)
