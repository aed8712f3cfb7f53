"""The run's checkpoints: `last.ckpt` always, `best.ckpt` by a validation metric when validation runs.

Lightning's `ModelCheckpoint` saves at validation (or epoch) ends and, at the end of training, writes
`last.ckpt` only if it had saved nothing before, so a run whose last steps came after its last
validation would leave a stale `last.ckpt`. This one also saves at the end whenever steps were taken
since the last save. Under MegaTrainStrategy each save goes through its checkpoint IO, which is atomic
(a crash mid-save leaves the previous file) and checksummed (docs/checkpoints.md).
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override


class RunCheckpoint(ModelCheckpoint):
    """`dirpath/last.ckpt` (the final weights and optimizer state: resume from it) and, with `monitor`,
    `dirpath/best.ckpt` (the best validation so far).

    Args:
        dirpath: the checkpoint directory.
        monitor: the logged metric that picks `best.ckpt` (e.g. `val/loss`); None: `last.ckpt` only.
        mode: `min` (a loss) or `max` (an accuracy).
    Cost: each save writes the whole training state (16 B/param with fp32 AdamW state, 12 compact),
    once per validation for each file, and once more at the end.
    """

    def __init__(self, dirpath: str, monitor: str | None = "val/loss", mode: str = "min") -> None:
        super().__init__(dirpath=dirpath, filename="best", monitor=monitor, mode=mode,
                         save_top_k=1 if monitor else 0, save_last=True, auto_insert_metric_name=False)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._should_skip_saving_checkpoint(trainer):  # steps were taken since the last save
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
