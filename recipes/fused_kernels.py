# python recipes/fused_kernels.py [--repeats 5] [--loss-only] [--shapes 7b 3b gpt-oss]
"""Fused kernels on one decoder layer and on the LM head + loss, against Hugging Face's eager code (issues 15, 18).

The question: how much of a streamed step's device time would a maintained kernel library (Liger Kernel: fused
RMSNorm, SwiGLU, rotary embedding; fused linear cross-entropy) or ``torch.compile`` of the block take away, and
how far do they move the numbers. One Qwen2.5 layer (7B shape at 16 x 2048 tokens, 3B shape at 8 x 2048), bf16
autocast, bf16 matmul weights and fp32 1-d weights and fp32 residual input (as the engine binds a block), forward
+ backward, run the two ways a streamed block runs: every activation kept ("full") and the kept blocks' default
(torch's selective checkpointing saving matmul and attention outputs, ``engine/selective.py``: "matmuls").
Then the head + loss over the same tokens: Hugging Face's ``ForCausalLMLoss`` on full logits, the package's
chunked loss (``CausalLM``: 4096-token chunks, each one's gradients taken in its forward, ``models/head_loss.py``),
the same chunks with autograd's cross-entropy (``chunked-autograd``: until 2026-12-05; ``chunked`` compiles
the cross-entropy and its gradient as one function), the same chunks each checkpointed and recomputed in the
backward (what it replaced, 2026-12-05), Liger's fused linear cross-entropy. ``--shapes gpt-oss``: GPT-OSS-20B's head (hidden 2880, 201 K vocabulary, 14 x 2048), the
loss only.
Prints one table: ms per call, the saved activations / peak memory, and the relative error against eager.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from megatrain_lightning.engine.selective import saving_matmuls  # noqa: E402

SHAPES = {  # hidden, intermediate, heads, kv heads, vocab, micro-batch
    "7b": (3584, 18944, 28, 4, 152064, 16),
    "3b": (2048, 11008, 16, 2, 151936, 8),
    "gpt-oss": (2880, 2880, 64, 8, 201088, 14),  # the head + loss only (its blocks are not Qwen2's)
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def layer(shape: str, kind: str) -> tuple[Any, Any]:
    from transformers import Qwen2Config
    from transformers.models.qwen2 import modeling_qwen2

    h, i, heads, kv, vocab, _ = SHAPES[shape]
    cfg = Qwen2Config(hidden_size=h, intermediate_size=i, num_attention_heads=heads, num_key_value_heads=kv,
                      vocab_size=vocab)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        block, rotary = modeling_qwen2.Qwen2DecoderLayer(cfg, 0), modeling_qwen2.Qwen2RotaryEmbedding(cfg)
    block.to(torch.bfloat16)
    for p in block.parameters():
        if p.dim() < 2:  # fp32 1-d weights, as the engine binds them
            p.data = p.data.float() + 0.1 * torch.randn_like(p.data.float())
    if kind == "liger":
        from liger_kernel.transformers.monkey_patch import _patch_rms_norm_module, _patch_swiglu_module
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

        _patch_swiglu_module(block.mlp, LigerSwiGLUMLP)
        _patch_rms_norm_module(block.input_layernorm)
        _patch_rms_norm_module(block.post_attention_layernorm)
    return block, rotary


def time_layer(block: Any, rotary: Any, x: torch.Tensor, pos: torch.Tensor, saves: str, repeats: int,
               compiled: bool) -> tuple[float, float, torch.Tensor, list[torch.Tensor]]:
    def fwd(xi: torch.Tensor) -> torch.Tensor:
        out = block(xi, position_embeddings=rotary(xi, pos), position_ids=pos)
        return out[0] if isinstance(out, tuple) else out

    body: Callable[[torch.Tensor], torch.Tensor] = (lambda xi: saving_matmuls(fwd, xi)) if saves == "matmuls" else fwd
    if compiled:
        body = torch.compile(body)
    saved = [0.0]

    def once() -> tuple[torch.Tensor, list[torch.Tensor]]:
        block.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = body(xi)
        saved[0] = (torch.cuda.memory_allocated() - before) / 2**30
        out.float().pow(2).mean().backward()
        return out.detach(), [xi.grad] + [p.grad for p in block.parameters()]

    once()
    once()  # warm-up (and compile)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        out, grads = once()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats, saved[0], out, grads


def head_loss(kind: str, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if kind == "hf":
        from transformers.loss.loss_utils import ForCausalLMLoss

        logits = F.linear(hidden, weight)
        return ForCausalLMLoss(logits.unsqueeze(0), labels.unsqueeze(0), vocab_size=weight.shape[0])
    shifted = F.pad(labels, (0, 1), value=-100)[1:]
    if kind == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss()(weight, hidden, shifted)
    n = (shifted != -100).sum()
    head = torch.nn.Linear(hidden.shape[-1], weight.shape[0], bias=False, device="meta")
    head.weight = weight  # the Parameter itself: its gradient lands in weight.grad
    if kind in ("chunked", "chunked-autograd"):  # the package's CausalLM: 4096-token chunks, gradients in the forward
        from megatrain_lightning.models import head_loss

        if kind == "chunked":  # the cross-entropy and its gradient compiled as one function (the default)
            return head_loss.chunked_head_loss(head, hidden, shifted, 4096) / n
        fused, head_loss._fused = head_loss._fused, lambda logits: None  # autograd's path (until 2026-12-05)
        try:
            return head_loss.chunked_head_loss(head, hidden, shifted, 4096) / n
        finally:
            head_loss._fused = fused
    from torch.utils.checkpoint import checkpoint  # "checkpointed": each chunk recomputed in the backward

    def chunk_loss(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(h).float(), t, ignore_index=-100, reduction="sum")

    return sum(checkpoint(chunk_loss, h, t, use_reentrant=False)
               for h, t in zip(hidden.split(4096), shifted.split(4096))) / n


def time_loss(shape: str, kind: str, repeats: int) -> tuple[float, float, torch.Tensor, list[torch.Tensor]]:
    h, _, _, _, vocab, mb = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens = mb * 2048
    hidden0 = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
    weight = torch.nn.Parameter(torch.randn(vocab, h, device="cuda", generator=g) * 0.02)
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)

    def once() -> tuple[torch.Tensor, list[torch.Tensor]]:
        weight.grad = None
        hid = hidden0.detach().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = head_loss(kind, hid, weight, labels)
        loss.backward()
        return loss.detach(), [hid.grad, weight.grad]

    once()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        loss, grads = once()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats, (torch.cuda.max_memory_allocated() - base) / 2**30, loss, grads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--loss-only", action="store_true", help="the head + loss table only")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    print("| shape | what | saves | ms | saved / peak GiB | output vs eager | worst grad vs eager |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for shape in a.shapes:
        h, _, _, _, _, mb = SHAPES[shape]
        x = torch.randn(mb, 2048, h, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        pos = torch.arange(2048, device="cuda").expand(mb, -1)
        for saves in () if a.loss_only or shape == "gpt-oss" else ("full", "matmuls"):
            ref: tuple[torch.Tensor, list[torch.Tensor]] | None = None
            kinds = ["eager", "liger"] + ([] if a.no_compile else ["compile"])
            for kind in kinds:
                try:
                    block, rotary = layer(shape, "liger" if kind == "liger" else "eager")
                    if kind == "liger":
                        from liger_kernel.transformers.rope import liger_rotary_pos_emb
                        from transformers.models.qwen2 import modeling_qwen2

                        original, modeling_qwen2.apply_rotary_pos_emb = modeling_qwen2.apply_rotary_pos_emb, liger_rotary_pos_emb
                    try:
                        ms, saved, out, grads = time_layer(block, rotary, x, pos, saves, a.repeats, kind == "compile")
                    finally:
                        if kind == "liger":
                            modeling_qwen2.apply_rotary_pos_emb = original
                except Exception as err:  # noqa: BLE001 (a row that says why)
                    print(f"| {shape} layer | {kind} | {saves} | failed: {type(err).__name__}: {str(err)[:200]} | | | |", flush=True)
                    continue
                if ref is None:
                    ref = (out, grads)
                    errs = ("", "")
                else:
                    errs = (f"{rel(out, ref[0]):.2e}", f"{max(rel(g, r) for g, r in zip(grads, ref[1])):.2e}")
                print(f"| {shape} layer | {kind} | {saves} | {ms:.1f} | {saved:.2f} | {errs[0]} | {errs[1]} |", flush=True)
                del block, rotary, out, grads
                torch.cuda.empty_cache()
            del ref
        ref = None
        for kind in ("hf", "chunked", "chunked-autograd", "checkpointed", "liger"):
            try:
                ms, peak, loss, grads = time_loss(shape, kind, a.repeats)
            except Exception as err:  # noqa: BLE001
                print(f"| {shape} head+loss | {kind} | | failed: {type(err).__name__}: {str(err)[:200]} | | | |", flush=True)
                continue
            if ref is None:
                ref, errs = (loss, grads), ("", "")
            else:
                errs = (f"{rel(loss, ref[0]):.2e}", f"{max(rel(g, r) for g, r in zip(grads, ref[1])):.2e}")
            print(f"| {shape} head+loss | {kind} | | {ms:.1f} | {peak:.2f} | {errs[0]} | {errs[1]} |", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
