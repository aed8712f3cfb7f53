"""GPU checks of the long-context path (issue 17), skipped without CUDA (see conftest.py).

    python -m pytest -q -s tests/test_long_context_cuda.py     # -s shows the printed figures

(a) the attention CausalLM's models call (SDPA, causal, no mask, GQA) runs on the flash kernel alone: with
    every other backend disabled it still runs (a mask or an unsupported shape would need another one);
(b) the chunked MLP (norm folded) is exact in fp32 on the GPU (TF32 off): a layer's gradients within 1e-5;
(c) one Qwen2.5-7B-shaped layer at 64 K tokens under bf16 autocast: the chunked MLP's recompute + backward
    peak is far below the unchunked one and within 15% of the planner's ``block_working_set``;
(d) training at 8 K tokens under bf16-mixed (a 4-layer Qwen2, 6 steps): the chunked MLP, bf16 saved inputs
    and both together against the unchunked, fp32-saved run under MegaTrainStrategy and against Lightning's
    default strategy: every loss within 1%.
"""

from __future__ import annotations

import gc

import pytest
import torch

from megatrain_lightning.models import chunk_mlp
from megatrain_lightning.plan import PlanShape
from megatrain_lightning.plan.memory import block_working_set

pytestmark = pytest.mark.cuda


def _layers(hidden: int, inter: int, heads: int, kv: int, dtype: torch.dtype):
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        holder = torch.nn.Module()
        holder.layers = torch.nn.ModuleList([Qwen2DecoderLayer(cfg, i) for i in range(2)])
    holder.to(dtype)
    for p in holder.parameters():
        if p.dim() < 2:
            p.data = p.data.float()
    with torch.device("cuda"):
        rope = Qwen2RotaryEmbedding(cfg)
    return holder, rope


def _grads(layer, rope, x, autocast: bool):  # noqa: ANN001
    layer.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_()
    pos = rope(leaf, torch.arange(x.shape[1], device="cuda")[None])
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = layer(leaf, position_embeddings=pos)
    out.float().square().mean().backward()
    return [leaf.grad] + [p.grad.clone() for p in layer.parameters()]


def test_flash_attention_alone_serves_the_call() -> None:
    holder, rope = _layers(512, 1024, 8, 2, torch.bfloat16)
    flags = [torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
             torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()]
    try:
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_math_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
        grads = _grads(holder.layers[0], rope, torch.randn(1, 4096, 512, device="cuda"), autocast=True)
        assert all(torch.isfinite(g).all() for g in grads)
    finally:
        for f, on in zip((torch.backends.cuda.enable_flash_sdp, torch.backends.cuda.enable_mem_efficient_sdp,
                          torch.backends.cuda.enable_math_sdp, torch.backends.cuda.enable_cudnn_sdp), flags):
            f(on)


def test_chunked_mlp_is_exact_in_fp32_on_the_gpu() -> None:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        holder, rope = _layers(256, 704, 4, 2, torch.float32)
        x = torch.randn(2, 1000, 256, device="cuda")
        ref = _grads(holder.layers[0], rope, x, autocast=False)
        chunk_mlp(holder, 96)
        got = _grads(holder.layers[0], rope, x, autocast=False)
        worst = max(float((g - r).norm() / r.norm()) for g, r in zip(got, ref))
        print(f"\n(b) chunked MLP, fp32 on the GPU: worst relative gradient difference {worst:.2e}")
        assert worst <= 1e-5
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.set_float32_matmul_precision(saved[1])


def _peak(layer, rope, tokens: int) -> float:  # noqa: ANN001
    x = torch.randn(1, tokens, 3584, device="cuda")
    pos = rope(x, torch.arange(tokens, device="cuda")[None])
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    leaf = x.detach().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(leaf, position_embeddings=pos)
    out.backward(torch.randn_like(x))
    torch.cuda.synchronize()
    layer.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated() - base + x.nbytes  # the input counts in the planner's working set


def test_chunked_working_set_of_a_7b_layer_against_the_planner() -> None:
    holder, rope = _layers(3584, 18944, 28, 4, torch.bfloat16)
    layer, tokens, chunk = holder.layers[0], 65536, 4096
    shape = PlanShape(total_params=233_058_304, block_params=233_058_304, largest_block=233_058_304,
                      resident_params=0, head_params=0, layers=1, heads=28, head_dim=128, kv_dim=512, hidden=3584,
                      intermediate=18944, vocab=1, mlp_params=3 * 3584 * 18944, mlp_folds_norm=True)
    plain = _peak(layer, rope, tokens)
    chunk_mlp(holder, chunk)
    chunked = _peak(layer, rope, tokens)
    planned = block_working_set(shape, tokens, mlp_chunk_tokens=chunk)
    planned_plain = block_working_set(shape, tokens)
    print(f"\n(c) 7B layer, {tokens} tokens: recompute + backward peak {plain / 1e9:.2f} GB unchunked (planned "
          f"{planned_plain / 1e9:.2f}), {chunked / 1e9:.2f} GB with MLP chunks of {chunk} (planned {planned / 1e9:.2f})")
    assert chunked < 0.6 * plain
    assert abs(planned / chunked - 1) <= 0.15


def _long_context_run(strategy, mlp_chunk_tokens=None):  # noqa: ANN001, ANN202
    from conftest import fit

    from megatrain_lightning.models import CausalLM

    class Module(CausalLM):
        def train_dataloader(self):  # noqa: ANN202
            g = torch.Generator().manual_seed(5)
            ids = torch.randint(0, 2048, (6, 8192), generator=g)
            return torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in ids], batch_size=1)

    config = dict(model_type="qwen2", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=2048, max_position_embeddings=8192,
                  tie_word_embeddings=False)
    factory = lambda: Module(config=config, lr=1e-3, loss_chunk_tokens=2048, mlp_chunk_tokens=mlp_chunk_tokens)  # noqa: E731
    return fit(factory, strategy, accelerator="gpu", precision="bf16-mixed", max_steps=6, deterministic=False)


def test_chunked_mlp_and_bf16_saved_inputs_train_within_one_percent_at_8k_tokens() -> None:
    from conftest import megatrain

    runs = {
        "lightning default": _long_context_run(None),
        "megatrain": _long_context_run(megatrain()),
        "chunked MLP": _long_context_run(megatrain(), mlp_chunk_tokens=2048),
        "bf16 saved inputs": _long_context_run(megatrain(saved_inputs_dtype="compute")),
        "both": _long_context_run(megatrain(saved_inputs_dtype="compute"), mlp_chunk_tokens=2048),
    }
    ref = runs["megatrain"].losses
    assert len(ref) == 6 and ref[-1] < ref[0]
    worst = {}
    for name, run in runs.items():
        worst[name] = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref))
    print("\n(d) 8 K tokens, bf16-mixed, 6 steps: worst relative loss difference to the unchunked fp32-saved "
          "megatrain run: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()) + f"; losses {[round(x, 4) for x in ref]}")
    assert all(v <= 0.01 for v in worst.values()), worst
