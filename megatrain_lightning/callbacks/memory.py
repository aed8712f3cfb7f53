"""Peak memory: GPU memory reserved by torch's caching allocator, and host resident set size.

Reserved, not allocated, is what the device must actually have free (fragmentation included); host
RSS peak is what the kernel's out-of-memory killer sees. Both are cheap counters: no sync. Also the
allocator's retries: each time it found no free block for a request it released its cached blocks and
asked the device again (``num_alloc_retries``), a device synchronisation in the middle of a step: a step that
does this steadily is slower by it, with nothing else to show for it.
"""

from __future__ import annotations

import logging
import resource
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

GB = 1024**3
log = logging.getLogger(__name__)


def peak_host_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def peak_gpu_reserved_bytes() -> int:
    """Peak bytes the CUDA caching allocator held on the current device; 0 without CUDA."""
    return torch.cuda.max_memory_reserved() if torch.cuda.is_available() else 0


def gpu_alloc_retries() -> int:
    """How many times the CUDA caching allocator released its cache to retry an allocation (a device
    synchronisation each); 0 without CUDA."""
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0)) if torch.cuda.is_available() else 0


class MemoryMonitor(pl.Callback):
    """Logs `peak_gpu_mem_GiB` (reserved), `peak_host_rss_GiB` and `gpu_alloc_retries` (so far) every training
    step; warns once (rank 0) when the allocator retries in a step after the first ``settle_steps`` of a fit
    (the strategy's first steps of every fit, a resumed one too, measure and may try placements)."""

    def __init__(self, settle_steps: int = 2) -> None:
        self.settle_steps = settle_steps
        self._retries: int | None = None
        self._first_step = 0  # global_step when this fit started (a resumed fit measures its placement again)
        self._warned = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._retries, self._first_step = None, trainer.global_step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        pl_module.log("peak_host_rss_GiB", peak_host_rss_bytes() / GB, on_step=True, on_epoch=False)
        if torch.cuda.is_available():
            pl_module.log("peak_gpu_mem_GiB", peak_gpu_reserved_bytes() / GB, on_step=True, on_epoch=False)
        retries = gpu_alloc_retries()
        if retries or self._retries:
            pl_module.log("gpu_alloc_retries", float(retries), on_step=True, on_epoch=False)
        before, self._retries = self._retries, retries
        settled = trainer.global_step - self._first_step > self.settle_steps
        if before is not None and retries > before and settled and not self._warned and trainer.is_global_zero:
            self._warned = True
            log.warning(
                "step %d: torch's CUDA caching allocator found no free block %d time(s) and released its cache to "
                "retry (a device synchronisation each; %d so far): device memory is fragmented near its limit, "
                "which slows every such step. Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the "
                "environment before the run, or leave more room: set strategy.engine.keep_activations or "
                "cache_weights below what the run chose (its log says)", trainer.global_step, retries - before, retries)
