# python recipes/defaults_vs_baselines.py --model qwen2_5_3b --micro-batch 8 --modes megatrain-default all-on-gpu deepspeed
# python recipes/defaults_vs_baselines.py --modes megatrain-default megatrain-set --engine update_on_device=6
"""``Trainer(strategy="megatrain")`` with nothing set, against the baselines its users would otherwise run.

One plain Hugging Face causal LM (random init from the config in ``conf/model/``, its own full-logit loss:
``model(input_ids, labels=input_ids).loss``) in one LightningModule, bf16-mixed, trained by each mode in a
process of its own, side by side in one call:

* ``megatrain-default``: ``Trainer(strategy="megatrain")``: fp32 masters and AdamW on the host, the placement
  chosen by the strategy from its measured first step (the chosen placement and its predicted step are
  reported).
* ``megatrain-set``: the same with the ``EngineConfig`` fields ``--engine`` names set (the row is labelled
  with them; what they leave open the strategy still chooses).
* ``all-on-gpu``: Lightning's default strategy, everything on the GPU, Hugging Face per-layer gradient
  checkpointing, ``torch.optim.AdamW(fused=True)``.
* ``deepspeed``: ``DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True,
  pin_memory=True)`` with ``DeepSpeedCPUAdam``, as its users configure it.

Step time is the mean over the steps after ``--warmup`` (the first two of megatrain-default measure and try
its placement): the time from the synchronised end of the last warm-up step to the synchronised end of the
last step, divided by the steps between, as a training run goes (no synchronisation between its steps;
until 2026-12-04 every batch end was synchronised, which also waited for copies a run leaves in flight
across the step boundary). ``step_times`` are the host's times between batch ends, for the spread. Model
TFLOPS: ``PlanShape.model_flops_per_token`` (6·N without the input embedding lookup, plus 12·L·H·Q·T). One
JSON line per mode, rows appended to ``--out`` (.csv/.md, ``recipes/bench.py``'s columns); exits 1 if any
mode failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODES = ("megatrain-default", "megatrain-set", "all-on-gpu", "deepspeed")


def engine_fields(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` pairs as EngineConfig fields: ints, true/false, null, else the string."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, text = pair.partition("=")
        low = text.lower()
        out[key] = {"true": True, "false": False, "null": None, "none": None}.get(low, int(text) if text.isdigit() else text)
    return out


def _config(model: str, layers: int | None = None) -> Any:
    from omegaconf import OmegaConf

    from megatrain_lightning.conf_dir import config_dir
    from megatrain_lightning.models.build import hf_config

    cfg = OmegaConf.load(config_dir() / "model" / f"{model}.yaml")
    config = hf_config(OmegaConf.to_container(cfg.config, resolve=True))
    config.use_cache = False
    if layers:  # the model cut to its first `layers` blocks (a shape whose whole does not fit the GPU or the host)
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    return config


def _flops_per_token(model: str, seq: int, layers: int | None = None) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from megatrain_lightning.plan import PlanShape

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(_config(model, layers))
    return PlanShape.of(meta).model_flops_per_token(seq)


def _label(args: argparse.Namespace) -> str:
    return f"{args.model} ({args.layers} layers)" if args.layers else args.model


def one(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    class PlainLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_config(_config(args.model, args.layers), attn_implementation="sdpa")
            if args.liger:  # what a user who wants Liger's kernels writes in their own module
                from liger_kernel.transformers import _apply_liger_kernel_to_instance

                _apply_liger_kernel_to_instance(model=self.model)
            if mode == "all-on-gpu":
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> Any:
            if mode == "deepspeed":
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(self.parameters(), lr=1e-5)
            return torch.optim.AdamW(self.parameters(), lr=1e-5, fused=mode == "all-on-gpu" or None)

    per_step = args.accumulate
    first, last = per_step * args.warmup - 1, per_step * (args.warmup + args.steps) - 1  # batch indices

    class Timer(pl.Callback):
        megatrain_reads_weights = False

        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *_: Any) -> None:
            if len(self.ends) in (first, last):
                torch.cuda.synchronize()  # the window's two ends only: the steps between run as in training
            self.ends.append(time.perf_counter())

    if mode == "megatrain-default":
        import megatrain_lightning  # noqa: F401  (registers "megatrain")

        strategy: Any = "megatrain"
    elif mode == "megatrain-set":
        from megatrain_lightning import EngineConfig, MegaTrainStrategy

        strategy = MegaTrainStrategy(EngineConfig(**engine_fields(args.engine)))
    elif mode == "deepspeed":
        from lightning.pytorch.strategies import DeepSpeedStrategy

        strategy = DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True, pin_memory=True)
    else:
        strategy = "auto"
    steps = args.warmup + args.steps
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, _config(args.model, args.layers).vocab_size, (steps * args.micro_batch * args.accumulate, args.seq_len),
                         generator=g)
    timer = Timer()
    trainer = pl.Trainer(accelerator="cuda", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=steps,
                         accumulate_grad_batches=args.accumulate, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    t0 = time.perf_counter()
    trainer.fit(PlainLM(), torch.utils.data.DataLoader(data, batch_size=args.micro_batch))
    assert len(timer.ends) == last + 1, (len(timer.ends), last)
    step = (timer.ends[last] - timer.ends[first]) / args.steps
    tokens = args.micro_batch * args.seq_len * args.accumulate
    row = dict(mode=mode, model=_label(args), micro_batch=args.micro_batch, seq_len=args.seq_len,
               accumulate=args.accumulate, step_s=round(step, 4), tokens_per_s=round(tokens / step),
               tflops=round(tokens / step * _flops_per_token(args.model, args.seq_len, args.layers) / 1e12, 1),
               peak_gpu_mem_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2),
               peak_host_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
               wall_s=round(time.perf_counter() - t0, 1),
               step_times=[round(b - a, 3) for a, b in zip(timer.ends[::per_step], timer.ends[per_step::per_step])])
    chosen = getattr(trainer.strategy, "placement_summary", None)
    if chosen is not None:
        row["placement"] = chosen
        row["predicted_step_s"] = chosen.get("predicted_step_s")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2_5_3b")
    ap.add_argument("--layers", type=int, default=None, help="cut the model to its first N blocks")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--modes", nargs="+", default=[m for m in MODES if m != "megatrain-set"], choices=MODES)
    ap.add_argument("--engine", nargs="*", default=[], help="EngineConfig fields key=value for megatrain-set")
    ap.add_argument("--liger", action="store_true",
                    help="the module applies Liger Kernel to its model (fused norm, SwiGLU, rotary, linear cross-entropy)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per mode")
    ap.add_argument("--out", default=None, help="rows appended to OUT.csv / OUT.md (recipes/bench.py's columns)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("ROW " + json.dumps(one(args.one, args)), flush=True)
        return 0
    rows, failed = [], False
    if "megatrain-set" in args.modes:
        from megatrain_lightning import EngineConfig

        EngineConfig(**engine_fields(args.engine))  # a wrong field fails here, before any mode runs
    for mode in args.modes:
        cmd = [sys.executable, __file__, "--one", mode, *sys.argv[1:]]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("ROW ")), None)
            status = "ok" if proc.returncode == 0 and line else f"error (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            proc, line, status = None, None, f"timed out after {args.timeout} s"
        row = json.loads(line[4:]) if line else dict(mode=mode, model=_label(args))
        if mode == "megatrain-set":
            row["mode"] = "megatrain " + " ".join(args.engine)  # what was set, not "default"
        if args.liger:
            row["mode"] += " (module with Liger Kernel)"
        row["status"] = status
        if status != "ok":
            failed = True
            tail = (proc.stderr or proc.stdout)[-2500:] if proc is not None else ""
            print(f"{mode}: {status}\n{tail}", file=sys.stderr)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        sys.path.insert(0, str(ROOT / "recipes"))
        from bench import append

        machine = os.environ.get("MACHINE", "?")
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
        import transformers

        for r, mode in zip(rows, args.modes):
            r.update(date=str(datetime.date.today()), strategy=r["mode"], params=None,
                     machine=f"{machine}: {gpu}, torch {torch.__version__}, transformers {transformers.__version__}",
                     command=f"python recipes/defaults_vs_baselines.py --model {args.model} "
                             + (f"--layers {args.layers} " if args.layers else "") + "--micro-batch "
                             f"{args.micro_batch} --seq-len {args.seq_len} --accumulate {args.accumulate} "
                             + ("--liger " if args.liger else "") + "--modes "
                             + ("megatrain-set --engine " + " ".join(args.engine) if mode == "megatrain-set" else mode))
        append(rows, Path(args.out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
