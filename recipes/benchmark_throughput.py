# python recipes/benchmark_throughput.py --model qwen2_5_3b --strategies megatrain single_device --steps 10
"""Side-by-side throughput of MegaTrainStrategy and its baselines on one GPU, one subprocess per run.

Each run builds a randomly initialised Hugging Face model of a published shape, trains it for
``--steps`` optimizer steps on random tokens (no padding) and reports the mean step time over the
steps after ``--warmup``, tokens/s, model TFLOPS = (6 N + 12 L H Q T) x tokens/s (N: parameters a
token passes through, excluding the input embedding table; recompute not counted), MFU against the
measured 803 TFLOPS bf16 matmul rate of an H200, peak GPU memory (reserved) and peak host RSS.
Results are appended to ``--out`` as CSV and Markdown with the columns of issue 4.

Strategies: ``megatrain`` (host store, streamed blocks, host AdamW), ``single_device`` (everything on
the GPU, Hugging Face per-layer gradient checkpointing, fused AdamW), ``deepspeed_zero3_offload``
(Lightning's DeepSpeedStrategy, stage 3, parameters and optimizer offloaded to the host,
DeepSpeedCPUAdam, per-layer checkpointing; needs deepspeed installed, see shared/GPU.md).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {
    # published Qwen2.5 hyperparameters
    "qwen2_5_1_5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2_5_3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2_5_7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2_5_14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
COLUMNS = ["date", "machine", "model", "params_b", "strategy", "micro_batch", "accumulate", "seq_len", "step_s",
           "tokens_per_s", "model_tflops", "mfu", "peak_gpu_gib", "peak_host_rss_gib", "status"]
H200_BF16_TFLOPS = 803.0


def _one_run(args: argparse.Namespace) -> dict:
    import lightning as L
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import megatrain_lightning

    shape = dict(SHAPES[args.model])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    cfg = Qwen2Config(**shape, max_position_embeddings=32768, rope_theta=1e6, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    target = "cuda" if args.strategy == "single_device" else "cpu"
    model = model.to_empty(device=target)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg, device=target)  # its buffers, rebuilt
    if cfg.tie_word_embeddings:  # the published shape; transformers 5.17 left a meta-built head untied
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():  # cheap random init: drawn on the GPU, copied where the model lives
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                p.copy_(torch.randn(p.shape, device="cuda").mul_(0.02))
    if args.strategy != "megatrain":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    steps_t: list[float] = []
    chunk = args.loss_chunk if args.strategy == "megatrain" else 0
    from torch.utils.checkpoint import checkpoint

    class Bench(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, _):
            if not chunk:
                return self.model(input_ids=batch, labels=batch).loss
            # LM head and cross-entropy in chunks of tokens, each recomputed in the backward: the full
            # [tokens, vocab] logits (and their fp32 upcast and gradient) never exist at once.
            hidden = self.model.model(input_ids=batch).last_hidden_state[:, :-1].reshape(-1, cfg.hidden_size)
            targets = batch[:, 1:].reshape(-1)
            head = self.model.lm_head

            def part(h, t):
                return torch.nn.functional.cross_entropy(head(h).float(), t, reduction="sum")

            total = sum(checkpoint(part, h, t, use_reentrant=False) for h, t in zip(hidden.split(chunk), targets.split(chunk)))
            return total / targets.numel()

        def configure_optimizers(self):
            if args.strategy == "deepspeed_zero3_offload":
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(self.parameters(), lr=1e-5, weight_decay=0.1, adamw_mode=True)
            return torch.optim.AdamW(self.parameters(), lr=1e-5, weight_decay=0.1, fused=True)

    class Timer(L.Callback):
        """Step time = from one optimizer step's end to the next (device idle at both): everything a step
        costs, including host updates that run on into the next step's forward (overlap_next_forward)."""

        megatrain_reads_weights = False  # it only times

        def on_train_batch_start(self, trainer, module, batch, i) -> None:
            if i == 0:
                torch.cuda.synchronize()
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, i) -> None:
            if (i + 1) % args.accumulate == 0:
                torch.cuda.synchronize()
                t = time.perf_counter()
                steps_t.append(t - self.t0)
                self.t0 = t
                engine = getattr(trainer.strategy, "engine", None)
                if engine is not None:  # per step: host AdamW busy, and the GPU-feeding thread's wait for it
                    hosts = trainer.strategy.precision_plugin.host_optimizers.values()
                    busy, wait = sum(h.update_seconds for h in hosts), engine.update_wait_s
                    last = getattr(self, "last", (0.0, 0.0))
                    print(f"host step {len(steps_t)}: {steps_t[-1]:.4f} s, AdamW busy {busy - last[0]:.4f} s, "
                          f"forward waited for updates {wait - last[1]:.4f} s", file=sys.stderr, flush=True)
                    self.last = (busy, wait)

    callbacks: list = [Timer()]
    if args.breakdown and args.strategy == "megatrain":
        callbacks.append(_breakdown(torch))
    if args.profile and args.strategy == "megatrain":
        callbacks.append(_profiler(args, trainer_ref := []))
    n_batches = args.steps * args.accumulate
    data = torch.randint(0, cfg.vocab_size, (n_batches * args.micro_batch, args.seq_len))
    loader = torch.utils.data.DataLoader(data, batch_size=args.micro_batch)
    if args.host_threads:
        torch.set_num_threads(args.host_threads)
    if args.strategy == "megatrain":
        strategy = megatrain_lightning.MegaTrainStrategy(
            slots=args.slots, overlap_optimizer=not args.no_overlap, overlap_next_forward=not args.no_run_on,
            keep_activations=args.keep, kept_saves=args.kept_saves, cache_weights=args.cache, offload_inputs=args.offload_inputs,
            host_state=args.host_state, grad_buffers=args.grad_buffers, host_threads=args.worker_threads or None,
            bf16_grads=False if args.fp32_grads else True if args.bf16_grads else None,
            split_embedding_update=args.split_embedding)
    elif args.strategy == "deepspeed_zero3_offload":
        from lightning.pytorch.strategies import DeepSpeedStrategy

        strategy = DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True)
    else:
        strategy = "auto"
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed",
                        max_steps=args.steps, accumulate_grad_batches=args.accumulate, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    if args.profile and args.strategy == "megatrain":
        trainer_ref.append(trainer)
    torch.cuda.reset_peak_memory_stats()
    if args.sync_debug:
        _sync_debug(torch, trainer)
    trainer.fit(Bench(), loader)
    step_s = sum(steps_t[args.warmup:]) / len(steps_t[args.warmup:])
    def numel(p) -> int:  # DeepSpeed ZeRO-3 leaves empty partitions in the module: ds_numel is the full size
        return getattr(p, "ds_numel", p.numel())

    n_total = sum(numel(p) for p in model.parameters())
    embed = numel(model.model.embed_tokens.weight)
    head = cfg.vocab_size * cfg.hidden_size
    tied = model.lm_head.weight is model.model.embed_tokens.weight  # as built, whatever the config says
    n_flop = n_total - embed + (head if tied else 0)  # the head's matmul counts once either way
    L_, H = cfg.num_hidden_layers, cfg.num_attention_heads
    Q = cfg.hidden_size // H
    tokens = args.micro_batch * args.seq_len * args.accumulate
    flops_per_token = 6 * n_flop + 12 * L_ * H * Q * args.seq_len
    tflops = flops_per_token * tokens / step_s / 1e12
    return dict(params_b=round(n_total / 1e9, 3), step_s=round(step_s, 4), tokens_per_s=round(tokens / step_s),
                model_tflops=round(tflops, 1), mfu=round(tflops / H200_BF16_TFLOPS, 3),
                peak_gpu_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2),
                peak_gpu_alloc_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                peak_host_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                step_times=[round(t, 4) for t in steps_t])


def _sync_debug(torch, trainer) -> None:
    """Count host-device synchronisations made from the package's own code inside the timed steps.

    torch.cuda.set_sync_debug_mode("warn") makes every synchronising CUDA call warn from the Python
    line that made it; the documented sync point (the gradient drain at the end of the backward) is
    listed apart. Printed as ``sync-debug`` lines at the end of the run.
    """
    import atexit
    import collections
    import warnings

    import lightning as L

    hits: collections.Counter = collections.Counter()
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message) or "sync" in str(message).lower():
            where = "megatrain_lightning" if "megatrain_lightning" in filename else "other"
            hits[(where, f"{Path(filename).name}:{lineno}")] += 1
            return
        original(message, category, filename, lineno, file, line)

    class Mode(L.Callback):
        def on_train_batch_start(self, *a) -> None:
            if a[-1] >= args_warmup:
                torch.cuda.set_sync_debug_mode("warn")

        def on_train_batch_end(self, *a) -> None:
            torch.cuda.set_sync_debug_mode("default")

    args_warmup = 1
    warnings.simplefilter("always")
    warnings.showwarning = show
    trainer.callbacks.append(Mode())

    def report() -> None:
        for (where, site), n in sorted(hits.items()):
            print(f"sync-debug {where} {site}: {n}", file=sys.stderr, flush=True)
        print(f"sync-debug total from megatrain_lightning: {sum(n for (w, _), n in hits.items() if w == 'megatrain_lightning')}",
              file=sys.stderr, flush=True)

    atexit.register(report)


def _breakdown(torch):
    """Per-step phases of megatrain, host-timed with a device sync at each boundary (slightly perturbs
    the overlap it measures): forward, backward (to the end of the gradient drain), the step's tail
    (resident update, remaining host work), and the host-worker AdamW time (overlapped with the backward)."""
    import lightning as L

    from megatrain_lightning.engine.pipeline import StreamingEngine
    from megatrain_lightning.optim import HostOptimizer

    marks: dict[str, float] = {}
    adam = {"s": 0.0, "last": 0.0, "first": None}
    orig_finish, orig_update = StreamingEngine.finish_backward, HostOptimizer.overlap_update

    def finish(self):
        orig_finish(self)
        torch.cuda.synchronize()
        marks["bwd_end"] = time.perf_counter()

    def overlap_update(self):
        update = orig_update(self)

        def timed(store):
            t = time.perf_counter()
            if adam["first"] is None:
                adam["first"] = t
            update(store)
            adam["s"] += time.perf_counter() - t
            adam["last"] = time.perf_counter()

        return timed

    StreamingEngine.finish_backward, HostOptimizer.overlap_update = finish, overlap_update

    class Breakdown(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, i) -> None:
            torch.cuda.synchronize()
            marks["start"] = time.perf_counter()
            adam["s"], adam["first"] = 0.0, None

        def on_before_backward(self, trainer, module, loss) -> None:
            torch.cuda.synchronize()
            marks["fwd_end"] = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, i) -> None:
            torch.cuda.synchronize()
            end = time.perf_counter()
            print(f"breakdown step {i}: forward {marks['fwd_end'] - marks['start']:.3f} s, backward "
                  f"{marks['bwd_end'] - marks['fwd_end']:.3f} s, tail {end - marks['bwd_end']:.3f} s; host AdamW "
                  f"{adam['s']:.3f} s busy, first update {(adam['first'] or 0) - marks['fwd_end']:+.3f} s into the backward, last update {adam['last'] - marks['bwd_end']:+.3f} s after backward",
                  file=sys.stderr, flush=True)

    return Breakdown()


def _profiler(args, trainer_ref: list):
    """torch.profiler over ``--profile`` optimizer steps after the warm-up: per-stream busy times of the
    device (compute, host→device, device→host), GPU idle, and the host optimizer's busy time on its worker
    (recipes/profile_breakdown.py). Printed as a ``profile`` line; the trace goes to outputs/profile/."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_breakdown", Path(__file__).with_name("profile_breakdown.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def host_busy() -> float:
        hosts = trainer_ref[0].strategy.precision_plugin.host_optimizers.values()
        return sum(h.update_seconds for h in hosts)

    def report(d: dict) -> None:
        print("profile " + json.dumps({k: round(v, 4) for k, v in d.items()}), file=sys.stderr, flush=True)

    return mod.StepProfiler(first_step=args.warmup, steps=args.profile, out_dir="outputs/profile",
                            on_result=report, host_busy=host_busy)


def _grads_label(args: argparse.Namespace) -> str:
    """What the megatrain run's block gradients are: fp32, or bf16 widened in the one-pass kernel or chunk
    by chunk (the default, bf16_grads=None, is bf16 where the kernel builds, fp32 otherwise)."""
    from megatrain_lightning.engine import native_adam

    if args.fp32_grads:
        return "-fp32grads"
    native = native_adam.kernel() is not None
    if not native:
        print(f"one-pass kernel unavailable ({native_adam.unavailable_reason()})")
    if args.bf16_grads:
        return "-bf16grads-native" if native else "-bf16grads-chunked"
    return "-bf16grads-native" if native else "-fp32grads"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_5_3b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="override the number of blocks (0: published)")
    ap.add_argument("--strategies", nargs="+", default=["megatrain", "single_device"])
    ap.add_argument("--strategy", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--no-overlap", action="store_true", help="megatrain: host step after the backward")
    ap.add_argument("--keep", type=int, default=0, help="megatrain: keep_activations (blocks not recomputed)")
    ap.add_argument("--cache", type=int, default=0, help="megatrain: cache_weights (blocks whose weights stay)")
    ap.add_argument("--offload-inputs", action="store_true", help="megatrain: saved block inputs in host memory")
    ap.add_argument("--host-state", default="fp32", choices=["fp32", "compact"], help="megatrain: host_state")
    ap.add_argument("--loss-chunk", type=int, default=0,
                    help="megatrain: LM head + loss in chunks of this many tokens (0: Hugging Face's full logits)")
    ap.add_argument("--sync-debug", action="store_true", help="count synchronising CUDA calls per source line")
    ap.add_argument("--host-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--breakdown", action="store_true", help="megatrain: print per-step phase times")
    ap.add_argument("--profile", type=int, default=0,
                    help="megatrain: profile this many steps after the warm-up and print the measured breakdown")
    ap.add_argument("--worker-threads", type=int, default=0, help="megatrain: host_threads (0: automatic)")
    ap.add_argument("--kept-saves", default="all", choices=["all", "matmuls"], help="megatrain: kept_saves")
    ap.add_argument("--no-run-on", action="store_true", help="megatrain: overlap_next_forward=False")
    ap.add_argument("--bf16-grads", action="store_true",
                    help="megatrain: bf16_grads=True (default None: on where the one-pass kernel builds)")
    ap.add_argument("--split-embedding", action="store_true", help="megatrain: split_embedding_update=True")
    ap.add_argument("--fp32-grads", action="store_true",
                    help="megatrain: bf16_grads=False (fp32 gradients; the default before the one-pass kernel)")
    ap.add_argument("--grad-buffers", type=int, default=None,
                    help="megatrain: grad_buffers (0: own accumulators; default: automatic)")
    ap.add_argument("--timeout", type=int, default=540)
    ap.add_argument("--out", default=f"recipes/results/{datetime.date.today()}-h200-throughput")
    args = ap.parse_args()
    if args.strategy:  # child process: one run, JSON on the last line
        print(json.dumps(_one_run(args)))
        return
    rows = []
    for strategy in args.strategies:
        label = strategy
        if strategy == "megatrain":
            label += ("-no-overlap" if args.no_overlap else "") + (f"-keep{args.keep}" if args.keep else "") + (
                "-matmuls" if args.kept_saves == "matmuls" else "") + (
                f"-cache{args.cache}" if args.cache else "") + ("-offload-inputs" if args.offload_inputs else "") + (
                f"-losschunk{args.loss_chunk}" if args.loss_chunk else "") + (
                "-compact" if args.host_state == "compact" else "") + ("-no-runon" if args.no_run_on else "") + (
                _grads_label(args)) + (
                "-splitemb" if args.split_embedding else "") + (
                f"-gradbuf{args.grad_buffers}" if args.grad_buffers is not None else "") + (
                f"-worker{args.worker_threads}" if args.worker_threads else "")
        label += f"-{args.host_threads}threads" if args.host_threads else ""
        cmd = [sys.executable, __file__, "--strategy", strategy] + [
            a for a in sys.argv[1:] if a != "--strategies" and a not in args.strategies
        ]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        row = dict(date=str(datetime.date.today()), machine=os.environ.get("MACHINE", "nvidia-h200"),
                   model=args.model + (f"-{args.layers}l" if args.layers else ""), strategy=label,
                   micro_batch=args.micro_batch, accumulate=args.accumulate, seq_len=args.seq_len)
        if proc.returncode == 0:
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"{label}: step times {result.pop('step_times')} ({time.time() - t0:.0f} s with setup)")
            print("\n".join(l for l in proc.stderr.splitlines() if l.startswith(("breakdown", "sync-debug", "profile", "[profile", "host step"))))
            print(f"peak GPU allocated {result.get('peak_gpu_alloc_gib')} GiB")
            row.update(result, status="ok")
        else:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
            row.update(status="out of memory" if "out of memory" in proc.stderr.lower() else f"error: {tail[0][:200]}")
            print(proc.stderr[-3000:])
        rows.append(row)
        print(row, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = not out.with_suffix(".csv").exists()
    with out.with_suffix(".csv").open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(rows)
    with out.with_suffix(".md").open("a") as f:
        if new:
            f.write("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n")
        for r in rows:
            f.write("| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |\n")
        f.write(f"\ncommand: `python {' '.join(sys.argv)}`\n\n")


if __name__ == "__main__":
    main()
