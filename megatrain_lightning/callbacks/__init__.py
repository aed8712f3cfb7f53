"""Callbacks: throughput (tokens/s, TFLOPS, MFU), peak memory, the run's summary, checkpoints, HF export."""

from megatrain_lightning.callbacks.checkpoint import RunCheckpoint
from megatrain_lightning.callbacks.hf_export import HFExport
from megatrain_lightning.callbacks.memory import MemoryMonitor
from megatrain_lightning.callbacks.run_summary import RunSummary
from megatrain_lightning.callbacks.throughput import ThroughputMonitor

__all__ = ["HFExport", "MemoryMonitor", "RunCheckpoint", "RunSummary", "ThroughputMonitor"]
