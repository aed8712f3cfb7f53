# python recipes/moe_layer.py --micro-batch 16 --seq-len 2048 [--shape gpt-oss|qwen3] [--attn ...] [--small]
"""One streamed block's work for a mixture of experts: GPT-OSS-20B- or Qwen3-30B-A3B-shaped decoder layers,
forward and backward.

Builds a Hugging Face model of `--layers` real-shape layers in bf16 on the GPU (`--shape gpt-oss`: alternating
sliding-window and full attention with sinks, 32 experts top-4, hidden 2880; `--shape qwen3`: 128 experts top-8
of intermediate 768, hidden 2048, QK-norm, attention `sdpa` by default), feeds it `inputs_embeds` of
micro-batch x seq tokens, and times forward + backward (CUDA events, median of `--reps` after one warm-up) for
each attention implementation x expert implementation. Prints per layer: ms, model TFLOPS counting active parameters
(6 x active params + 12 x heads x head_dim x seq per token, attention counted whole), peak GPU memory; and,
at micro-batch 1, each variant's relative error against an fp64 eager reference on the same weights
(output, and the gradients of the parameters the table's header names).

`--compile` adds, for each variant, the layers run through `torch.compile` (each layer's forward; its own
row): "compiled, experts eager" (the experts' forward under `torch.compiler.disable`: a graph break on each
side, attention, norms and router fused) and "compiled" (the experts too).

`--small` runs a hidden-256 model on the CPU in fp32 (the CI smoke test).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import sys

import torch


from megatrain_lightning.models import sink_attention  # noqa: E402  registers attn_implementation="fused_sinks"


# per shape: the attention implementations timed by default, and the parameters whose gradients are checked
DEFAULT_ATTN = {"gpt-oss": "eager,flex_attention,fused_sinks", "qwen3": "sdpa"}
WATCH = {
    "gpt-oss": ["layers.0.self_attn.sinks", "layers.1.self_attn.sinks", "layers.1.self_attn.q_proj.weight",
                "layers.1.mlp.router.weight", "layers.1.mlp.experts.gate_up_proj_bias", "layers.1.mlp.experts.down_proj"],
    "qwen3": ["layers.1.self_attn.q_proj.weight", "layers.1.self_attn.q_norm.weight", "layers.1.mlp.gate.weight",
              "layers.1.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj"],
}


def build(args: argparse.Namespace, device: str, dtype: torch.dtype):
    small = args.small
    if args.shape == "qwen3":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(
            vocab_size=256, hidden_size=256 if small else 2048, intermediate_size=512 if small else 6144,
            moe_intermediate_size=128 if small else 768, head_dim=32 if small else 128,
            num_attention_heads=8 if small else 32, num_key_value_heads=2 if small else 4,
            num_hidden_layers=args.layers, num_experts=8 if small else 128, num_experts_per_tok=2 if small else 8,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
            attn_implementation="eager", experts_implementation="eager",
        )
        torch.manual_seed(0)
        with torch.device(device):
            return Qwen3MoeForCausalLM(config).model.to(dtype), config
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=256, hidden_size=256 if small else 2880, intermediate_size=256 if small else 2880,
        head_dim=64, num_attention_heads=8 if small else 64, num_key_value_heads=2 if small else 8,
        num_hidden_layers=args.layers, num_local_experts=8 if small else 32, num_experts_per_tok=2 if small else 4,
        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * (args.layers // 2),
        max_position_embeddings=131072, rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        attn_implementation="eager", experts_implementation="eager",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = GptOssForCausalLM(config).model.to(dtype)  # the decoder: embeddings unused (inputs_embeds)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.sinks.normal_(0, 1)
    return model, config


def active_flops_per_token(config, seq: int) -> float:
    h, d, hq, hkv = config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads
    attn = h * (hq + 2 * hkv) * d + hq * d * h
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size  # Qwen3-MoE: the experts'
    experts = config.num_experts_per_tok * (h * 2 * inter + inter * h)
    router = getattr(config, "num_local_experts", None) or config.num_experts
    router *= h
    return 6 * (attn + experts + router) + 12 * hq * d * seq


def run(model, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    for p in model.parameters():
        p.grad = None
    x = x.detach().requires_grad_()
    out = model(inputs_embeds=x).last_hidden_state
    # not out.pow(2).mean(): the final RMSNorm makes each row's mean square 1 whatever the weights, so that loss's
    # true gradients are ~0 and what backward returns is rounding (10 % apart between fp32 and fp64)
    out.float().sum(dim=-1).pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def compiled_copy(model, experts_eager: bool):
    """A copy of ``model`` whose decoder layers run through ``torch.compile`` (with ``experts_eager``: the experts'
    forward left out of the graphs, ``torch.compiler.disable``)."""
    copied = copy.deepcopy(model)
    for layer in copied.layers:
        if experts_eager:
            experts = layer.mlp.experts
            experts.forward = torch.compiler.disable(experts.forward)
        layer.compile()
    return copied


def top_kernels(model, x: torch.Tensor, device: str, n: int = 8) -> list[str]:
    """One forward + backward under torch.profiler: the `n` kernels with the most device time (which attention
    and grouped-matmul kernels really ran, and their share)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        run(model, x)
        if device == "cuda":
            torch.cuda.synchronize()
    attr = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    total = sum(getattr(e, attr) for e in events) or 1.0
    events.sort(key=lambda e: -getattr(e, attr))
    return [f"  {getattr(e, attr) / 1e3:8.1f} ms {100 * getattr(e, attr) / total:5.1f}%  x{e.count:<4d} {e.key[:110]}"
            for e in events[:n]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shape", choices=sorted(DEFAULT_ATTN), default="gpt-oss")
    ap.add_argument("--attn", default=None, help="comma-separated attention implementations (default: per shape, "
                    + "; ".join(f"{k}: {v}" for k, v in DEFAULT_ATTN.items()) + ")")
    ap.add_argument("--experts", default="grouped_mm")
    ap.add_argument("--compile", action="store_true",
                    help="each variant also with its layers compiled: experts eager, and experts compiled")
    ap.add_argument("--small", action="store_true", help="hidden 256 on the CPU in fp32 (smoke test)")
    ap.add_argument("--profile", action="store_true",
                    help="after timing a variant, one more run under torch.profiler: its 8 costliest device kernels")
    ap.add_argument("--check-fp32", action="store_true",
                    help="the errors of an fp32 copy (TF32 off) of each variant, not of the bf16 model: in bf16 the "
                         "routing itself differs from fp64's, and every variant's gradients with it")
    args = ap.parse_args(argv)
    args.attn = args.attn or DEFAULT_ATTN[args.shape]
    device = "cpu" if args.small or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model, config = build(args, device, dtype)
    model.train()
    rows, failed = [], False
    kernels: list[tuple[str, list[str]]] = []

    # accuracy at micro-batch 1 against an fp32 eager reference on the same weights
    seq = args.seq_len
    x1 = torch.randn(1, seq, config.hidden_size, device=device, generator=torch.Generator(device).manual_seed(1))
    ref_model = copy.deepcopy(model).double()  # fp32 eager lands within ~1e-6 of it on the CPU
    ref_model.set_attn_implementation("eager")
    ref_model.set_experts_implementation("eager")
    ref_out, ref_grads = run(ref_model, x1.double())
    del ref_model
    watch = WATCH[args.shape]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b).norm() / b.norm()).item()

    compiles = ["", "compiled, experts eager", "compiled"] if args.compile else [""]
    variants = [(a, e, c) for a in args.attn.split(",") for e in args.experts.split(",") for c in compiles]
    if device == "cpu":  # fp32 eager's own distance to the fp64 reference: what "exact" means here
        variants.insert(0, ("eager", "eager", ""))
    for attn, experts, compiled in variants:
        label = f"attn={attn} experts={experts}" + (f" {compiled}" if compiled else "")
        try:
            # "fused_sinks:unchunked": sliding-window layers through one masked call over all keys
            sink_attention.CHUNK_SLIDING = not attn.endswith(":unchunked")
            model.set_attn_implementation(attn.split(":")[0])
            model.set_experts_implementation(experts)
            timed = compiled_copy(model, experts_eager="eager" in compiled) if compiled else model
            if args.check_fp32:
                torch.backends.cuda.matmul.allow_tf32 = False
                checked = copy.deepcopy(model).float()
                if compiled:
                    checked = compiled_copy(checked, experts_eager="eager" in compiled)
                out, grads = run(checked, x1.float())
                del checked
            else:
                out, grads = run(timed, x1.to(dtype))
            errs = [rel(out, ref_out)] + [rel(grads[n], ref_grads[n]) for n in watch]
            del out, grads
            x = torch.randn(args.micro_batch, seq, config.hidden_size, device=device, dtype=dtype)
            run(timed, x)  # warm-up (flex attention and compiled layers compile here)
            times = []
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            for _ in range(args.reps):
                if device == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    run(timed, x)
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
                else:
                    t0 = time.perf_counter()
                    run(timed, x)
                    times.append(time.perf_counter() - t0)
            if args.profile:
                kernels.append((label, top_kernels(timed, x, device)))
            per_layer = statistics.median(times) / args.layers
            tokens = args.micro_batch * seq
            tflops = active_flops_per_token(config, seq) * tokens / per_layer / 1e12
            peak = torch.cuda.max_memory_reserved() / 2**30 if device == "cuda" else float("nan")
            del timed
            rows.append((label, f"{per_layer * 1e3:.1f}", f"{tflops:.1f}", f"{peak:.1f}",
                         " ".join(f"{e:.1e}" for e in errs)))
        except Exception as e:  # one variant failing is a row, not the end of the table
            failed = True
            rows.append((label, "error", f"{type(e).__name__}: {str(e)[:200]}", "", ""))
        if device == "cuda":
            torch.cuda.empty_cache()
    for label, lines in kernels:
        print(f"\n{label}: costliest kernels of one forward + backward")
        print("\n".join(lines))
    print(f"\n{args.shape} layer x {args.layers}, {args.micro_batch} x {seq} tokens, {device} {dtype}, "
          f"torch {torch.__version__}")
    names = ", ".join(n.removeprefix("layers.").replace(".self_attn", "").replace(".mlp", "") for n in watch)
    print(f"| variant | ms/layer fwd+bwd | model TFLOPS (active) | peak reserved GiB | rel err: out, {names} (mb 1 "
          f"vs fp64 eager{', fp32 copy' if args.check_fp32 else ''}) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
