"""Peak memory: GPU memory reserved by torch's caching allocator, and host resident set size.

Reserved, not allocated, is what the device must actually have free (fragmentation included); host
RSS peak is what the kernel's out-of-memory killer sees. Both are cheap counters: no sync.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

GB = 1024**3


def peak_host_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def peak_gpu_reserved_bytes() -> int:
    """Peak bytes the CUDA caching allocator held on the current device; 0 without CUDA."""
    return torch.cuda.max_memory_reserved() if torch.cuda.is_available() else 0


class MemoryMonitor(pl.Callback):
    """Logs `peak_gpu_mem_GiB` (reserved) and `peak_host_rss_GiB` every training step."""

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        pl_module.log("peak_host_rss_GiB", peak_host_rss_bytes() / GB, on_step=True, on_epoch=False)
        if torch.cuda.is_available():
            pl_module.log("peak_gpu_mem_GiB", peak_gpu_reserved_bytes() / GB, on_step=True, on_epoch=False)
