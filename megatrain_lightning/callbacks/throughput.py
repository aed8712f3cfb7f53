"""Training throughput as the field reports it: tokens/s, model TFLOPS, MFU, on the progress bar.

Tokens are real tokens (padding excluded, via the batch's attention mask when it has one). Model
FLOPs per token come from the module's `model_shape` (`6·N + 12·L·H·Q·T`, see `ModelShape`); MFU
divides by the hardware profile's peak. Times are wall-clock over whole steps, so data loading and
the optimizer step count, as they should; validation inside `fit` does not (the clock pauses).
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override


class ThroughputMonitor(pl.Callback):
    """Logs `tokens/s`, `TFLOPS` and `MFU` per window of steps; keeps whole-run figures in `summary`.

    Args:
        peak_tflops: the device's peak (bf16 dense) for MFU; None or 0 leaves MFU out.
        window: steps per progress-bar figure. Longer is steadier but updates less often; on CUDA
            each window costs one device synchronisation (without it the clock would stop when
            kernels are queued, not when they finish).
        skip_first: steps left out at the start (warm-up, allocator growth, kernel selection).
    """

    def __init__(self, peak_tflops: float | None = None, window: int = 10, skip_first: int = 2) -> None:
        super().__init__()
        self.peak_tflops = peak_tflops
        self.window = window
        self.skip_first = skip_first
        self.summary: dict[str, float] = {}  # whole run after skip_first: tokens/s, s/batch, TFLOPS, MFU
        self.last_batch_shape: tuple[int, ...] | None = None  # [micro-batch, sequence length]
        self._steps = 0
        self._paused_at: float | None = None
        self._window = _Span()
        self._run = _Span()

    @staticmethod
    def real_tokens(batch: Any) -> tuple[int, int]:
        """(non-padding tokens, sequence length) of a batch with `input_ids` [B, T]."""
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        # A small host sync per step for a padded batch; unpadded batches are counted for free.
        n = int(mask.sum()) if mask is not None else ids.numel()
        return n, ids.shape[1]

    def _now(self, trainer: pl.Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # sync point: once per window (and around validation)
        return time.perf_counter()

    def _rates(self, span: "_Span", elapsed: float) -> dict[str, float]:
        rates = {"tokens/s": span.tokens / elapsed, "s/batch": elapsed / max(span.steps, 1)}
        if span.flops:
            rates["TFLOPS"] = span.flops / elapsed / 1e12
            if self.peak_tflops:
                rates["MFU"] = rates["TFLOPS"] / self.peak_tflops
        return rates

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._steps += 1
        self.last_batch_shape = tuple(batch["input_ids"].shape)
        if self._steps < self.skip_first:
            return
        if self._run.start is None:  # the clock starts at the end of a step; it times the steps after
            self._run.start = self._window.start = self._now(trainer)
            return
        tokens, seq_len = self.real_tokens(batch)
        shape = getattr(pl_module, "model_shape", None)
        flops = shape.flops_per_token(seq_len) * tokens if shape is not None else 0.0
        self._window.add(tokens, flops)
        self._run.add(tokens, flops)
        if self._window.steps < self.window:
            return
        now = self._now(trainer)
        rates = self._rates(self._window, now - self._window.start)
        for name, value in rates.items():
            if name != "s/batch":
                pl_module.log(name, value, prog_bar=name != "MFU", on_step=True, on_epoch=False)
        self._window = _Span(start=now)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.training and self._run.start is not None:
            self._paused_at = self._now(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._paused_at is not None:
            paused = self._now(trainer) - self._paused_at
            self._run.start += paused
            self._window.start += paused
            self._paused_at = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._run.start is not None and self._run.steps:
            self.summary = self._rates(self._run, self._now(trainer) - self._run.start)


class _Span:
    """Tokens and FLOPs counted since `start` (a perf_counter time)."""

    def __init__(self, start: float | None = None) -> None:
        self.start = start
        self.steps, self.tokens, self.flops = 0, 0, 0.0

    def add(self, tokens: int, flops: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.flops += flops
