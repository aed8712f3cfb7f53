"""Training throughput as the field reports it: tokens/s, model TFLOPS, MFU, on the progress bar.

Tokens are real tokens (padding excluded, via the batch's attention mask when it has one). Model
FLOPs per token come from the module's `model_shape` (`6·N + 12·L·H·Q·T`, see `ModelShape`); MFU
divides by the hardware profile's peak. Times are wall-clock over whole steps, so data loading and
the optimizer step count, as they should.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override


class ThroughputMonitor(pl.Callback):
    """Logs `tokens/s`, `TFLOPS` and `MFU`, each averaged over a window of steps.

    Args:
        peak_tflops: the device's peak (bf16 dense) for MFU; None or 0 leaves MFU out.
        window: steps per measurement. Longer is steadier but updates the bar less often; on CUDA
            each window costs one device synchronisation (without it the clock would stop when
            kernels are queued, not when they finish).
        skip_first: steps left out at the start (warm-up, allocator growth, kernel selection).
    """

    def __init__(self, peak_tflops: float | None = None, window: int = 10, skip_first: int = 2) -> None:
        super().__init__()
        self.peak_tflops = peak_tflops
        self.window = window
        self.skip_first = skip_first
        self._steps = 0
        self._start: float | None = None
        self._tokens = 0
        self._flops = 0.0
        self._in_window = 0
        self.last_batch_shape: tuple[int, int] | None = None  # [micro-batch, sequence length]

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
            torch.cuda.synchronize()  # sync point, once per window
        return time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._steps += 1
        self.last_batch_shape = tuple(batch["input_ids"].shape)
        if self._steps < self.skip_first:
            return
        if self._start is None:  # the window opens at the end of a step; it counts the steps after
            self._start = self._now(trainer)
            return
        tokens, seq_len = self.real_tokens(batch)
        shape = getattr(pl_module, "model_shape", None)
        self._tokens += tokens
        self._flops += shape.flops_per_token(seq_len) * tokens if shape is not None else 0.0
        self._in_window += 1
        if self._in_window < self.window:
            return
        now = self._now(trainer)
        elapsed, self._start = now - self._start, now
        pl_module.log("tokens/s", self._tokens / elapsed, prog_bar=True, on_step=True, on_epoch=False)
        if shape is not None:
            tflops = self._flops / elapsed / 1e12
            pl_module.log("TFLOPS", tflops, prog_bar=True, on_step=True, on_epoch=False)
            if self.peak_tflops:
                pl_module.log("MFU", tflops / self.peak_tflops, on_step=True, on_epoch=False)
        self._tokens, self._flops, self._in_window = 0, 0.0, 0
