"""MemoryMonitor (callbacks/memory.py) under a real Trainer: the caching allocator's retries are logged per step
and, once they grow in a step after the first ones, named in one warning with what to change. The device counter
is replaced by a sequence here (a CPU machine has no allocator to fragment)."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel

import megatrain_lightning.callbacks.memory as memory
from megatrain_lightning.callbacks import MemoryMonitor


def warnings_of(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == memory.__name__ and r.levelno >= logging.WARNING]


def fit(monkeypatch: Any, counts: list[int]) -> tuple[pl.Trainer, list[float]]:
    calls = iter(counts)
    monkeypatch.setattr(memory, "gpu_alloc_retries", lambda: next(calls))
    logged: list[float] = []

    class Recorded(BoringModel):
        def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if name == "gpu_alloc_retries":
                logged.append(float(value))
            super().log(name, value, *args, **kwargs)

    trainer = pl.Trainer(max_steps=len(counts), callbacks=[MemoryMonitor()], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(Recorded())
    return trainer, logged


def test_retries_after_the_first_steps_are_logged_and_warned_once(monkeypatch: Any, caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger=memory.__name__):
        _, logged = fit(monkeypatch, [0, 3, 3, 3, 7, 9])  # 3 while placing (steps 1-2), then 4 and 2 more
    assert logged == [3.0, 3.0, 3.0, 7.0, 9.0]  # from the first non-zero count on
    warnings = warnings_of(caplog)
    assert len(warnings) == 1 and warnings[0].startswith("step 5: torch's CUDA caching allocator found no free block 4 time(s)")
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in warnings[0]


def test_no_retries_no_metric_and_no_warning(monkeypatch: Any, caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger=memory.__name__):
        _, logged = fit(monkeypatch, [0] * 5)
    assert logged == [] and not warnings_of(caplog)


def test_a_resumed_fit_settles_again_before_it_warns(monkeypatch: Any, caplog: Any, tmp_path: Any) -> None:
    """The strategy measures and tries a placement again in every fit: a fit resumed at step 4 counts its own
    first steps, retries there (a backed-off trial) warn nothing, later ones do."""
    calls = iter([0] * 4 + [0, 2, 2, 5])  # the first fit's 4 steps, then the resumed fit's steps 5-8
    monkeypatch.setattr(memory, "gpu_alloc_retries", lambda: next(calls))
    kwargs: dict[str, Any] = dict(callbacks=[MemoryMonitor()], logger=False, enable_progress_bar=False,
                                  enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)
    first = pl.Trainer(max_steps=4, **kwargs)
    first.fit(BoringModel())
    ckpt = tmp_path / "at4.ckpt"
    first.save_checkpoint(ckpt)
    with caplog.at_level(logging.WARNING, logger=memory.__name__):
        pl.Trainer(max_steps=8, **kwargs).fit(BoringModel(), ckpt_path=ckpt)
    warnings = warnings_of(caplog)
    assert len(warnings) == 1 and warnings[0].startswith("step 8: torch's CUDA caching allocator found no free block 3 time(s)")
