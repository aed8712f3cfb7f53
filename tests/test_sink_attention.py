"""`attn_implementation="fused_sinks"` (models/sink_attention.py) is GPT-OSS's eager attention exactly.

Tiny Hugging Face GPT-OSS models in fp32 on the CPU, the same weights under both implementations: the
logits and every parameter's gradient (the sink logits' included) agree to fp32 rounding, for the plain
causal case (SDPA's `is_causal` path), sliding-window layers shorter than the sequence and packed rows
(transformers' boolean masks), grouped and ungrouped heads, and head dims that are and are not multiples of 8.
Then the strategy: a GPT-OSS under `strategy="megatrain"` with `fused_sinks` trains as the default strategy
with eager attention does.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch

from conftest import assert_is_megatrain, assert_parity, fit
from megatrain_lightning.models import sink_attention
from zoo import TinyGptOss

transformers = pytest.importorskip("transformers")
from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402

sink_attention.register()
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _model(head_dim: int, kv_heads: int, window: int, layers: int = 2) -> GptOssForCausalLM:
    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, head_dim=head_dim, num_attention_heads=4,
        num_key_value_heads=kv_heads, num_hidden_layers=layers, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=window, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attn_implementation="eager", experts_implementation="eager",
    )
    model = GptOssForCausalLM(config)
    with torch.no_grad():  # sinks away from 0 (their init), some large: the sink must matter to be tested
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(4) * 3)
    return model


def _run(model: GptOssForCausalLM, impl: str, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, dict]:
    model = copy.deepcopy(model)
    model.set_attn_implementation(impl)
    logits = model(input_ids=ids, **kwargs).logits
    (logits.float() ** 2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("head_dim,kv_heads,window,seq", [
    (8, 2, 8, 24),   # grouped heads, a window under a third of the sequence: sliding layers in chunks
    (8, 2, 8, 12),   # a window over half the sequence: sliding layers through one masked call
    (8, 4, 64, 24),  # no grouping, window longer than the sequence: SDPA's causal path on every layer
    (6, 2, 5, 17),   # head dim not a multiple of 8 (padded to 8), odd lengths
])
def test_fused_sinks_equals_eager(head_dim: int, kv_heads: int, window: int, seq: int) -> None:
    model = _model(head_dim, kv_heads, window)
    ids = torch.randint(0, 64, (3, seq), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = _run(model, "eager", ids)
    logits, grads = _run(model, sink_attention.NAME, ids)
    assert _rel(logits, ref_logits) < 1e-5
    assert grads.keys() == ref_grads.keys()
    sinks = [n for n in grads if n.endswith("sinks")]
    assert sinks and all(ref_grads[n].abs().sum() > 0 for n in sinks)  # the sinks' gradient is tested, not zero
    worst = max(_rel(grads[n], ref_grads[n]) for n in grads)
    assert worst < 1e-4, worst


def test_fused_sinks_packed_rows_equal_eager() -> None:
    """Packed rows (position ids restarting per sample): transformers builds block-diagonal masks for both."""
    from megatrain_lightning.models.causal_lm import packed_inputs

    model = _model(8, 2, 4)
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(2))
    pos = torch.cat([torch.arange(7), torch.arange(13)]).repeat(2, 1)
    out = {}
    for impl in ("eager", sink_attention.NAME):
        m = copy.deepcopy(model)
        m.set_attn_implementation(impl)
        kwargs, _ = packed_inputs(m, ids, ids, pos)
        logits = m(**kwargs).logits
        (logits ** 2).mean().backward()
        out[impl] = logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert _rel(out[sink_attention.NAME][0], out["eager"][0]) < 1e-5
    assert max(_rel(out[sink_attention.NAME][1][n], g) for n, g in out["eager"][1].items()) < 1e-4
    # and the packing matters: the second sample's logits differ from the unpacked row's
    plain = model(input_ids=ids).logits.detach()
    assert _rel(out["eager"][0][:, 7:], plain[:, 7:]) > 1e-3


def test_fused_sinks_refuses_what_it_cannot_compute() -> None:
    model = _model(8, 2, 8)
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 16, 8)
    kv = torch.randn(1, 2, 16, 8)
    with pytest.raises(ValueError, match="sliding window"):  # a shorter window and no mask: never full attention
        sink_attention.fused_sinks_attention_forward(attn, q, kv, kv, None, s_aux=attn.sinks, sliding_window=8)
    with pytest.raises(ValueError, match="dropout"):
        sink_attention.fused_sinks_attention_forward(attn, q, kv, kv, None, dropout=0.1, s_aux=attn.sinks)
    with pytest.raises(ValueError, match="boolean"):
        sink_attention.fused_sinks_attention_forward(attn, q, kv, kv, torch.zeros(1, 1, 16, 16), s_aux=attn.sinks)


class SinkGptOss(TinyGptOss):
    """The zoo's tiny GPT-OSS with `fused_sinks` attention (the zoo's own is eager)."""

    def build_model(self) -> torch.nn.Module:
        model = super().build_model()
        model.set_attn_implementation(sink_attention.NAME)
        return model


def test_gpt_oss_with_fused_sinks_under_megatrain_matches_eager_under_the_default_strategy() -> None:
    """The zoo's tiny GPT-OSS trained 8 steps with the router loss on: MegaTrain with `fused_sinks` against
    Lightning's default strategy with eager attention (the reference every other GPT-OSS test uses)."""
    kwargs = dict(optimizer="adamw", lr=3e-3, scheduler=True, router_aux_loss_coef=0.5)
    ref = fit(partial(TinyGptOss, **kwargs))
    got = fit(partial(SinkGptOss, **kwargs), "megatrain")
    assert_is_megatrain(got)
    assert_parity(ref, got)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim,kv_heads,window,seq", [(8, 2, 8, 24), (64, 2, 128, 1024), (64, 2, 4096, 1024)])
def test_fused_sinks_equals_eager_on_the_gpu(head_dim: int, kv_heads: int, window: int, seq: int) -> None:
    """The same comparison through CUDA's SDPA kernels (TF32 off, fp32): GPT-OSS's head dim 64 and 128-token
    window at 1024 tokens (sliding layers in chunks), and a window past the sequence (the causal fast path)."""
    model = _model(head_dim, kv_heads, window).cuda()
    ids = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(1)).cuda()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        ref_logits, ref_grads = _run(model, "eager", ids)
        logits, grads = _run(model, sink_attention.NAME, ids)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert _rel(logits, ref_logits) < 1e-5
    assert grads.keys() == ref_grads.keys()
    worst = max(_rel(grads[n], ref_grads[n]) for n in grads)
    print(f"fused_sinks on the GPU, head dim {head_dim}, window {window}, {seq} tokens: logits "
          f"{_rel(logits, ref_logits):.2e}, worst gradient {worst:.2e}")
    assert worst < 1e-4, worst
