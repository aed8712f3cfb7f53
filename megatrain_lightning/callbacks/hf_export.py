"""Export the Hugging Face model inside a LightningModule while and after it trains.

    trainer = pl.Trainer(strategy="megatrain", callbacks=[HFExport("out/hf", dtype=torch.bfloat16)])

The weights are read through `trainer.strategy.lightning_module_state_dict()`, the same call a
Lightning checkpoint makes, so that the strategy first brings them to a readable state (MegaTrain waits
for pending host optimizer updates and moves resident parameters back to their host masters). Each
export replaces `dirpath` atomically (see `megatrain_lightning.export`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from transformers import PreTrainedModel
from typing_extensions import override

from megatrain_lightning.export import ExportError, export_hf


def find_hf_model(module: torch.nn.Module) -> tuple[str, PreTrainedModel]:
    """(name, model) of the first `transformers.PreTrainedModel` among `module.named_modules()`;
    the name is "" when `module` is one itself."""
    for name, sub in module.named_modules():
        if isinstance(sub, PreTrainedModel):
            return name, sub
    raise ExportError(
        f"HFExport: {type(module).__name__} holds no transformers.PreTrainedModel; the callback exports "
        "the first Hugging Face model it finds among the module's submodules"
    )


class HFExport(pl.Callback):
    """Writes the module's Hugging Face model to `dirpath` (config plus sharded safetensors).

    Args:
        dirpath: the export directory, replaced by each export (the latest one wins).
        every_n_epochs: also export after every n-th training epoch; None or 0: only at the end.
            Each export reads every weight once and writes it to disk, so on a large model keep it
            to what the disk bandwidth affords.
        on_train_end: export when training ends.
        dtype: floating-point dtype stored (e.g. `torch.bfloat16`, or its name `"bfloat16"` as a YAML config
            gives it: half the disk of fp32 weights); None keeps the training dtype.
        max_shard_bytes: largest shard file; it also bounds the host memory the export adds.
        tokenizer: saved next to the weights; None takes the module's `tokenizer` attribute when it
            has `save_pretrained` (a transformers tokenizer), else writes none.
    """

    def __init__(
        self,
        dirpath: str | Path,
        every_n_epochs: int | None = None,
        on_train_end: bool = True,
        dtype: torch.dtype | str | None = None,
        max_shard_bytes: int = 2 * 2**30,
        tokenizer: Any | None = None,
    ) -> None:
        super().__init__()
        if isinstance(dtype, str):
            named = getattr(torch, dtype.removeprefix("torch."), None)
            if not isinstance(named, torch.dtype) or not named.is_floating_point:
                raise ExportError(f"dtype={dtype!r}: expected a floating-point dtype name (bfloat16, float16, float32) or None")
            dtype = named
        if every_n_epochs is not None and (isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int) or every_n_epochs < 0):
            raise ExportError(f"every_n_epochs={every_n_epochs!r}: expected a non-negative integer or None")
        self.dirpath = Path(dirpath)
        self.every_n_epochs = every_n_epochs or 0
        self.export_on_train_end = on_train_end  # not `self.on_train_end`: that is the hook below
        self.dtype = dtype
        self.max_shard_bytes = max_shard_bytes
        self.tokenizer = tokenizer
        self.last_exported_step: int | None = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Fail before training, not after it; not in `setup`, which Lightning calls before `configure_model`
        # (where a module may create its Hugging Face model).
        find_hf_model(pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.export(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.export_on_train_end and self.last_exported_step != trainer.global_step:
            self.export(trainer, pl_module)

    def export(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Path:
        """Export now (rank 0 writes; every rank takes part in reading the state, which a sharded
        strategy may gather collectively)."""
        name, model = find_hf_model(pl_module)
        full = trainer.strategy.lightning_module_state_dict()  # sync point: settles pending updates
        prefix = f"{name}." if name else ""
        state = {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}
        tokenizer = self.tokenizer
        if tokenizer is None and callable(getattr(getattr(pl_module, "tokenizer", None), "save_pretrained", None)):
            tokenizer = pl_module.tokenizer
        if trainer.is_global_zero:
            export_hf(model, self.dirpath, self.max_shard_bytes, self.dtype, tokenizer=tokenizer, state_dict=state)
        trainer.strategy.barrier("HFExport")
        self.last_exported_step = trainer.global_step
        return self.dirpath.expanduser().resolve()
