"""What a run's `metrics.json` reports that Lightning keeps nowhere: loss over the run, the last validation.

The training loss on the progress bar (and in `callback_metrics`) is the last batch's, which on a small
batch is noise; the mean over the whole run and over its last batches are the figures to compare runs
by. Losses are summed on their device, so recording them costs no host sync per step.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override


class RunSummary(pl.Callback):
    """Keeps the training loss's mean over every batch and over the last `last_n`, and the step and
    `val/*` metrics of the last validation (which lets `train()` skip validating the final weights twice).

    Args:
        last_n: how many of the last training batches the second mean covers.
    """

    def __init__(self, last_n: int = 50) -> None:
        super().__init__()
        self.last_n = last_n
        self._sum: torch.Tensor | None = None
        self._count = 0
        self._last: deque[torch.Tensor] = deque(maxlen=last_n)
        self.last_val_step: int | None = None
        self.last_val_metrics: dict[str, float] = {}

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            return
        loss = loss.detach().float() * trainer.accumulate_grad_batches  # Lightning scales it down for accumulation
        self._sum = loss if self._sum is None else self._sum + loss
        self._count += 1
        self._last.append(loss)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.last_val_step = trainer.global_step
        self.last_val_metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}

    @property
    def summary(self) -> dict[str, float | None]:
        """`train_loss_mean_all_batches` and `train_loss_mean_last_<n>_batches` (None before any batch)."""
        if self._sum is None:
            return {"train_loss_mean_all_batches": None, f"train_loss_mean_last_{self.last_n}_batches": None}
        return {
            "train_loss_mean_all_batches": float(self._sum) / self._count,  # host sync: once, at the end
            f"train_loss_mean_last_{self.last_n}_batches": float(torch.stack(list(self._last)).mean()),
        }
