# python -m torch.distributed.run --nproc-per-node=2 tests/dp_worker.py OUT.pt --global-batch 8 --steps 4
"""One rank of a data-parallel test run (tests/test_data_parallel.py starts it under torchrun, or alone).

Trains the zoo's tiny Llama (or a model of big blocks, for the memory test) with ``strategy="megatrain"``
on ``devices = ranks per node``, each rank ``global_batch / world`` rows of every global batch
(Lightning's DistributedSampler), and writes, from global rank 0, the losses (each step's mean over the
ranks: the loss of the global batch), the final weights and optimizer state, and every rank's
proportional set size (PSS: pages shared by the ranks counted once between them).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import megatrain_lightning  # noqa: E402,F401  (registers strategy="megatrain")
from megatrain_lightning import MegaTrainStrategy  # noqa: E402
from megatrain_lightning.errors import ConfigError  # noqa: E402
from zoo import ScaledBlocks, TinyLlama, ZooModule  # noqa: E402


def pss_bytes() -> int:
    """This process's proportional set size (its private pages plus its share of shared ones)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Pss in /proc/self/smaps_rollup")


def arena_pss_bytes() -> int:
    """This process's share of the node's shared host store: the PSS of its mappings of arena files."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = len(head) >= 6 and "/megatrain-" in head[5]
        elif inside and line.startswith("Pss:"):
            total += int(head[1]) * 1024
    return total


class BigBlocks(ZooModule):
    """Blocks of two wide matrices and few tokens: host state far larger than the process itself. Built in
    configure_model (on the meta device under the strategy, initialised in the host store): no eager copy of
    the weights (3.2 GB at 24 blocks of width 2048) is made and freed first."""

    def __init__(self, blocks: int = 8, width: int = 1024, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.n_blocks, self.width = blocks, width
        self.blocks: nn.ModuleList | None = None

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        width = self.width
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(self.n_blocks))
        self.out = nn.Linear(width, 1)

    def make_data(self, n: int, seq_len: int, seed: int) -> torch.Tensor:
        return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))

    def compute_loss(self, batch: Any) -> torch.Tensor:
        (x,) = batch
        h = self.inp(x)
        for b in self.blocks:
            h = h + 0.1 * b(h)
        return self.out(h).square().mean()


class ClearState(pl.Callback):
    """Restarts Adam before one step on every rank (``optimizer.state.clear()``)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step == self.step:
            trainer.optimizers[0].state.clear()


class Record(pl.Callback):
    megatrain_reads_weights = False

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.pss: list[int] = []
        self.arena_pss: list[int] = []
        self.wide: list[int] = []
        self.store_bytes = 0

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"].detach().reshape(1)
        self.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))  # the global batch's loss

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        engine = trainer.strategy.engine
        # weights of two or more dimensions each rank holds in fp32 on the device (engine/wide_weights.py)
        wide = sum(1 for s in engine.stores for i in s.layout.wide if s.layout.params[i].dim() >= 2)
        mine = torch.tensor([pss_bytes(), arena_pss_bytes(), wide], dtype=torch.int64)
        every = trainer.strategy.all_gather(mine).reshape(-1, 3) if trainer.world_size > 1 else mine.reshape(1, 3)
        self.pss, self.arena_pss = [int(x) for x in every[:, 0]], [int(x) for x in every[:, 1]]
        self.wide = [int(x) for x in every[:, 2]]
        self.store_bytes = sum(t.numel() * t.element_size() for s in engine.all_stores() for t in s.shared_buffers())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--model", default="llama", choices=["llama", "big", "scaled"])
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--n-train", type=int, default=0, help="rows in the data set (default: one epoch of the steps)")
    ap.add_argument("--big-width", type=int, default=1024)
    ap.add_argument("--big-blocks", type=int, default=8)
    ap.add_argument("--save", help="a directory for ModelCheckpoint's last.ckpt (at each epoch's end)")
    ap.add_argument("--resume", help="resume from this checkpoint (trainer.fit(ckpt_path=...))")
    ap.add_argument("--no-host-memory-on-rank", type=int, default=-1,
                    help="this global rank sees 1 kB of host memory available (the setup check refuses there)")
    ap.add_argument("--skip-nonfinite", type=int, default=0)
    ap.add_argument("--nan-step", type=int, default=-1, help="global rank 0's loss is NaN at this step")
    ap.add_argument("--clear-state-at", type=int, default=-1, help="optimizer.state.clear() before this step")
    args = ap.parse_args(argv)
    if int(os.environ.get("RANK", "0")) == args.no_host_memory_on_rank:
        megatrain_lightning.host_memory.available_bytes = lambda: 1000  # type: ignore[attr-defined]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    per_rank = args.global_batch // world
    n_train = args.n_train or args.global_batch * args.steps * args.accumulate
    pl.seed_everything(0, verbose=False)
    if args.model == "llama":
        module: pl.LightningModule = TinyLlama(optimizer="adamw", lr=3e-3, scheduler=True, batch_size=per_rank, n_train=n_train)
    elif args.model == "scaled":  # layer scales of shape (1, dim): held in fp32 on the device under bf16-mixed
        module = ScaledBlocks(dropout=0.0, optimizer="adamw", lr=3e-3, scheduler=True, batch_size=per_rank, n_train=n_train)
    else:
        module = BigBlocks(args.big_blocks, args.big_width, optimizer="adamw", lr=1e-4, scheduler=False,
                           batch_size=per_rank, n_train=n_train)
    # Lightning's own DistributedSampler shuffles (with its seed) under several ranks only: the same sampler,
    # here, on every world size, so that global batch k is the same rows for 1, 2 or 4 ranks
    rank = int(os.environ.get("RANK", "0"))
    data = module.train_dataloader().dataset
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    module.train_dataloader = lambda: torch.utils.data.DataLoader(data, batch_size=per_rank, sampler=sampler)
    if args.nan_step >= 0 and rank == 0:  # on one rank only: every rank must skip that step
        loss_of = module.compute_loss
        module.compute_loss = lambda batch: loss_of(batch) * (float("nan") if module.trainer.global_step == args.nan_step else 1.0)
    record = Record()
    callbacks: list[pl.Callback] = [record]
    if args.clear_state_at >= 0:
        callbacks.append(ClearState(args.clear_state_at))
    if args.save:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=args.save, save_last=True, save_top_k=0))
    trainer = pl.Trainer(
        strategy=MegaTrainStrategy(skip_nonfinite=args.skip_nonfinite), accelerator="cpu", devices=local, num_nodes=args.nodes, max_steps=args.steps,
        logger=False, enable_checkpointing=bool(args.save), enable_progress_bar=False, enable_model_summary=False,
        deterministic=True, precision=args.precision, limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks,
        gradient_clip_val=args.clip or None, accumulate_grad_batches=args.accumulate, use_distributed_sampler=False,
    )
    pl.seed_everything(0, verbose=False)
    try:
        trainer.fit(module, ckpt_path=args.resume)
    except ConfigError as e:
        print(f"REFUSED on rank {rank}: {e}", flush=True)
        sys.exit(3)
    if trainer.is_global_zero:
        opt = trainer.optimizers[0]
        state: dict = {}
        moments: dict = {}
        if args.model != "big":  # (the memory test's model: its weights are not compared, and would fill the disk)
            state = {k: v.detach().clone() for k, v in module.state_dict().items()}
            moments = {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
                       for i, p in enumerate(q for g in opt.param_groups for q in g["params"])}
        torch.save({"losses": record.losses, "state": state, "moments": moments, "pss": record.pss,
                    "arena_pss": record.arena_pss, "wide": record.wide, "store_bytes": record.store_bytes, "world": world,
                    "steps": trainer.global_step, "skipped": trainer.strategy.precision_plugin.skipped_steps}, args.out)


if __name__ == "__main__":
    main()
