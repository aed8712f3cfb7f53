# python recipes/norm_kernels.py [--micro-batch 16] [--seq-len 2048] [--repeats 5]
"""One Qwen2.5-7B decoder layer, forward + backward under bf16 autocast (a kept block's passes), with Hugging
Face's RMSNorm and with torch's fused ``F.rms_norm`` in its place: milliseconds per layer and how far the
outputs and gradients move. The question it answers (issue 15): how much of the 7B step's compute-stream time
is the fp32 elementwise work of the norms (the profile of 2026-12-03 shows ~1 s per step of elementwise
kernels against ~2 s of matmuls), and whether a fused norm is a lever worth an option.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

H, I, HEADS, KV = 3584, 18944, 28, 4


def build(device: str):
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    cfg = Qwen2Config(hidden_size=H, intermediate_size=I, num_attention_heads=HEADS, num_key_value_heads=KV)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        block, rotary = Qwen2DecoderLayer(cfg, 0), Qwen2RotaryEmbedding(cfg)
    block.to(torch.bfloat16)
    for p in block.parameters():
        if p.dim() < 2:
            p.data = p.data.float() + 0.1 * torch.randn_like(p.data.float())  # fp32 1-d weights, as the engine binds them
    return block, rotary


def fused_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon)


def run(block, rotary, x, pos, repeats: int) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
    def once():
        block.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = block(xi, position_embeddings=rotary(xi, pos), position_ids=pos)
            out = out[0] if isinstance(out, tuple) else out
        out.float().pow(2).mean().backward()
        return out.detach(), [xi.grad] + [p.grad for p in block.parameters()]

    once()  # warm-up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        out, grads = once()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats, out, grads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    from transformers.models.qwen2 import modeling_qwen2

    block, rotary = build("cuda")
    x = torch.randn(a.micro_batch, a.seq_len, H, device="cuda")
    pos = torch.arange(a.seq_len, device="cuda").expand(a.micro_batch, -1)
    ms_hf, out_hf, g_hf = run(block, rotary, x, pos, a.repeats)
    original = modeling_qwen2.Qwen2RMSNorm.forward
    modeling_qwen2.Qwen2RMSNorm.forward = fused_forward
    try:
        ms_fused, out_f, g_f = run(block, rotary, x, pos, a.repeats)
    finally:
        modeling_qwen2.Qwen2RMSNorm.forward = original
    rel = lambda a_, b_: float((a_.double() - b_.double()).norm() / b_.double().norm())  # noqa: E731
    tokens = a.micro_batch * a.seq_len
    flops = (6 * 233_058_304 + 12 * H * a.seq_len) * tokens
    print(f"| norm | ms per layer (fwd + bwd) | model TFLOPS per layer | output vs HF | worst gradient vs HF |")
    print(f"| --- | --- | --- | --- | --- |")
    print(f"| Hugging Face Qwen2RMSNorm | {ms_hf:.1f} | {flops / ms_hf / 1e9:.1f} | | |")
    print(f"| torch F.rms_norm | {ms_fused:.1f} | {flops / ms_fused / 1e9:.1f} | {rel(out_f, out_hf):.2e} | "
          f"{max(rel(g, r) for g, r in zip(g_f, g_hf)):.2e} |")
    print(f"{tokens} tokens per layer; torch {torch.__version__}; peak allocated {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
