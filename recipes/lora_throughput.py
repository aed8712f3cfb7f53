# python recipes/lora_throughput.py --model qwen2_5_7b --steps 6 --micro-batch 8 --seq-len 2048
"""LoRA through MegaTrainStrategy on a Qwen2.5 shape whose base is held in bf16: tokens/s, GPU memory, host RSS.

The base model is built on the meta device in bf16 (what ``from_pretrained(torch_dtype=torch.bfloat16)``
would hold) and wrapped by ``peft.get_peft_model`` (LoRA on the attention and MLP projections); the strategy
materialises it block by block into the host store, where the frozen base stays bf16 (2 B/param, no
master, gradient or moments) and the adapters train fp32 masters. Weights are random: a pool of random
bf16 values copied into each tensor (``_PoolSource``), since initialising 14-32 B bf16 parameters on the
host one by one takes minutes and throughput does not depend on the values. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from typing import Any, Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatrain_lightning import EngineConfig, MegaTrainStrategy
from megatrain_lightning.conf_dir import config_dir
from megatrain_lightning.init import attach_weights_source
from megatrain_lightning.models.build import hf_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _PoolSource:
    """Fills every materialised tensor from one pool of random values (a weights source, init.py)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.pool = (torch.randn(1 << 26, generator=g, device="cpu") * 0.02).to(torch.bfloat16)  # not meta

    def fill(self, modules: Sequence[nn.Module]) -> None:
        with torch.no_grad():
            for m in modules:
                for name, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
                    if name in m._non_persistent_buffers_set:
                        continue
                    flat, k = t.view(-1), 0
                    while k < flat.numel():
                        n = min(flat.numel() - k, self.pool.numel())
                        flat[k : k + n].copy_(self.pool[:n])
                        k += n

    @property
    def complete(self) -> bool:
        return False


class LoraLM(pl.LightningModule):
    def __init__(self, model: str, rank: int) -> None:
        super().__init__()
        self.model_name, self.rank = model, rank
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        cfg = OmegaConf.load(config_dir() / "model" / f"{self.model_name}.yaml")
        config = hf_config(OmegaConf.to_container(cfg.config, resolve=True))
        config.use_cache = False
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
        base.requires_grad_(False)
        lora = LoraConfig(r=self.rank, lora_alpha=2 * self.rank, lora_dropout=0.0, target_modules=TARGETS)
        self.model = get_peft_model(base, lora)
        attach_weights_source(self.model.get_base_model(), _PoolSource())

    def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
        hf = self.model.get_base_model()
        hidden = hf.model(input_ids=batch).last_hidden_state[:, :-1].reshape(-1, hf.config.hidden_size)
        targets = batch[:, 1:].reshape(-1)
        head = hf.lm_head

        def part(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(head(h).float(), t, reduction="sum")

        total = sum(checkpoint(part, h, t, use_reentrant=False) for h, t in zip(hidden.split(4096), targets.split(4096)))
        return total / targets.numel()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


class Timer(pl.Callback):
    megatrain_reads_weights = False

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        if not self.times:
            _sync()
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        _sync()
        t = time.perf_counter()
        self.times.append(t - self.t0)
        self.t0 = t


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2_5_7b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--keep", type=int, default=0)
    ap.add_argument("--cache", type=int, default=0)
    ap.add_argument("--slots", type=int, default=3)
    args = ap.parse_args()
    module = LoraLM(args.model, args.rank)
    timer = Timer()
    strategy = MegaTrainStrategy(EngineConfig(slots=args.slots, keep_activations=args.keep, kept_saves="matmuls",
                                              cache_weights=args.cache))
    vocab = int(OmegaConf.load(config_dir() / "model" / f"{args.model}.yaml").config.vocab_size)
    data = torch.randint(0, vocab, (args.steps * args.micro_batch, args.seq_len))
    trainer = pl.Trainer(accelerator="auto", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[timer])
    t0 = time.perf_counter()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=args.micro_batch))
    params = list(module.parameters())
    step = sum(timer.times[args.warmup:]) / len(timer.times[args.warmup:])
    trainable = sum(p.numel() for p in params if p.requires_grad)
    print(json.dumps(dict(
        model=args.model, rank=args.rank, params_b=round(sum(p.numel() for p in params) / 1e9, 3),
        trainable_m=round(trainable / 1e6, 2), frozen_dtypes=sorted({str(p.dtype) for p in params if not p.requires_grad}),
        tokens_per_step=args.micro_batch * args.seq_len, step_s=round(step, 4),
        tokens_per_s=round(args.micro_batch * args.seq_len / step), step_times=[round(t, 3) for t in timer.times],
        peak_gpu_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2) if torch.cuda.is_available() else 0,
        peak_host_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        keep=args.keep, cache=args.cache, wall_s=round(time.perf_counter() - t0, 1))))


if __name__ == "__main__":
    main()
