# python recipes/long_context_layer.py [--tokens 32768 131072 262144] [--backends flash cudnn] [--out ...]
"""One Qwen2.5-7B decoder layer at long context on one GPU, as MegaTrainStrategy runs it: time and memory.

For each sequence length and SDPA backend the layer runs the engine's three passes on a 1 x T x 3584 fp32
residual input under bf16 autocast, its weights in bf16 (norm gains fp32), the MLP in chunks
(``models/chunked_mlp.py``, the norm folded in): a forward without grad, the recompute with grad, and the
backward. Printed and written as a markdown table: the seconds of each pass (CUDA events), hardware TFLOPS
(8·N + the attention a causal flash kernel runs: 4.5 x 2·T·h per token, forward + recompute + 2.5x backward),
model TFLOPS per layer (6·N + 12·h·T per token: the DESIGN.md §6 convention the issue's targets use),
and the peak allocated during the recompute + backward (with the layer's input) against the planner's
``block_working_set``.

Which backend reaches the issue's 550 model TFLOPS at 256 K is what this answers: torch's default SDPA
choice for bf16, causal, no mask, GQA (``enable_gqa``) is flash attention (FlashAttention-2 kernels);
cuDNN's (FlashAttention-3-class on Hopper) is tried by disabling the others.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
H, I, HEADS, KV, LAYER_PARAMS = 3584, 18944, 28, 4, 233_058_304


def layer(chunk: int, device: str) -> torch.nn.Module:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    from megatrain_lightning.models import chunk_mlp

    cfg = Qwen2Config(hidden_size=H, intermediate_size=I, num_attention_heads=HEADS, num_key_value_heads=KV)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        block = Qwen2DecoderLayer(cfg, 0)
    with torch.device("meta"):  # find_blocks wants a list of two like blocks: the second costs nothing
        other = Qwen2DecoderLayer(cfg, 1)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([block, other])
    block.to(torch.bfloat16)
    for p in block.parameters():
        if p.dim() < 2:
            p.data = p.data.float()  # the engine binds 1-d weights as fp32 casts of the slot
    chunk_mlp(holder, chunk)
    return block


def backend_flags(name: str) -> None:
    b = torch.backends.cuda
    b.enable_flash_sdp(name == "flash")
    b.enable_cudnn_sdp(name == "cudnn")
    b.enable_mem_efficient_sdp(name == "efficient")
    b.enable_math_sdp(False)  # a fallback to the T x T math kernel must fail, not run out of memory slowly


def measure(block: torch.nn.Module, tokens: int, rotary, device: str) -> dict[str, float]:  # noqa: ANN001
    cuda = device == "cuda"
    x = torch.randn(1, tokens, H, device=device)
    pos = rotary(x, torch.arange(tokens, device=device)[None])
    grad_out = torch.randn(1, tokens, H, device=device)
    marks = []

    def mark() -> None:  # a sync point: the passes are timed one by one
        if cuda:
            torch.cuda.synchronize()
        marks.append(time.perf_counter())

    mark()
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        block(x, position_embeddings=pos)  # the forward: nothing kept
    mark()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    leaf = x.detach().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        out = block(leaf, position_embeddings=pos)  # the recompute
    mark()
    out.backward(grad_out)
    mark()
    # the working set as the planner counts it: its input (allocated before, in `base`) and everything the
    # recompute and backward allocate on top; the incoming gradient (also in `base`) is the planner's loss side
    peak = torch.cuda.max_memory_allocated() - base + x.nbytes if cuda else float("nan")
    times = [marks[i + 1] - marks[i] for i in range(3)]
    block.zero_grad(set_to_none=True)
    return {"forward_s": times[0], "recompute_s": times[1], "backward_s": times[2], "peak_gb": peak / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072, 262144])
    ap.add_argument("--backends", nargs="+", default=["flash", "cudnn"])
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--out", default=f"recipes/results/{datetime.date.today()}-h200-long-context-layer.md")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (no memory figures)")
    ap.add_argument("--small", action="store_true",
                    help="a 7B-like layer at hidden 256 (2 heads of 128, 1 KV head, intermediate 1354): a smoke run "
                         "that a 2-core CPU finishes in seconds (a 7B layer under bf16 autocast takes minutes there)")
    args = ap.parse_args()
    device = args.device
    global H, I, HEADS, KV, LAYER_PARAMS
    if args.small:
        H, I, HEADS, KV = 256, 1354, 2, 1
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from megatrain_lightning.plan import PlanShape
    from megatrain_lightning.plan.memory import block_working_set

    torch.manual_seed(0)
    block = layer(args.chunk, device)
    LAYER_PARAMS = sum(p.numel() for p in block.parameters())  # 233,058,304 at the 7B shape
    cfg = Qwen2Config(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=max(args.tokens))
    with torch.device(device):
        rotary = Qwen2RotaryEmbedding(cfg)
    shape = PlanShape(total_params=LAYER_PARAMS, block_params=LAYER_PARAMS, largest_block=LAYER_PARAMS,
                      resident_params=0, head_params=0, layers=1, heads=HEADS, head_dim=H // HEADS,
                      kv_dim=KV * H // HEADS, hidden=H, intermediate=I, vocab=1, mlp_params=3 * H * I,
                      mlp_folds_norm=True)
    rows = []
    for backend in args.backends:
        if device == "cuda":
            backend_flags(backend)
        for tokens in args.tokens:
            try:
                measure(block, min(tokens, 8192), rotary, device)  # warm-up: kernel selection, allocator
                r = measure(block, tokens, rotary, device)
            except RuntimeError as err:  # an ineligible backend: "No available kernel", or out of memory
                rows.append((backend, tokens, None, str(err).splitlines()[0][:120]))
                if device == "cuda":
                    torch.cuda.empty_cache()
                continue
            total = r["forward_s"] + r["recompute_s"] + r["backward_s"]
            attn_hw = 4.5 * 2 * tokens * H  # per token: causal flash, forward + recompute + backward (2.5x)
            hw_tflops = tokens * (8 * LAYER_PARAMS + 2 * 3 * H * I + attn_hw) / total / 1e12
            model_tflops = tokens * (6 * LAYER_PARAMS + 12 * H * tokens) / total / 1e12
            planned = block_working_set(shape, tokens, mlp_chunk_tokens=args.chunk) / 1e9
            rows.append((backend, tokens, dict(r, total_s=total, hw_tflops=hw_tflops, model_tflops=model_tflops,
                                               planned_gb=planned), None))
            print(rows[-1], flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    lines = [
        "# One Qwen2.5-7B layer at long context: forward, recompute and backward (MLP in chunks of "
        f"{args.chunk} tokens, norm folded)",
        "",
        f"- date: {datetime.date.today()}; machine: {platform.node()}, "
        f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU (smoke run)'}; torch "
        f"{torch.__version__}; command: `python recipes/long_context_layer.py --tokens {' '.join(map(str, args.tokens))} "
        f"--backends {' '.join(args.backends)} --chunk {args.chunk}`",
        "",
        "| backend | tokens | forward s | recompute s | backward s | total s | hw TFLOPS | model TFLOPS | peak GB "
        "(recompute + backward) | planned GB | error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for backend, tokens, r, err in rows:
        if r is None:
            lines.append(f"| {backend} | {tokens} | | | | | | | | | {err} |")
        else:
            lines.append(f"| {backend} | {tokens} | {r['forward_s']:.3f} | {r['recompute_s']:.3f} | {r['backward_s']:.3f} "
                         f"| {r['total_s']:.3f} | {r['hw_tflops']:.0f} | {r['model_tflops']:.0f} | {r['peak_gb']:.2f} "
                         f"| {r['planned_gb']:.2f} | {(r['planned_gb'] / r['peak_gb'] - 1):+.1%} |")
    text = "\n".join(lines) + "\n"
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
