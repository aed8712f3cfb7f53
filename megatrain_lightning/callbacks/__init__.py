"""Measurement callbacks: throughput (tokens/s, TFLOPS, MFU) and peak memory."""

from megatrain_lightning.callbacks.hf_export import HFExport
from megatrain_lightning.callbacks.memory import MemoryMonitor
from megatrain_lightning.callbacks.throughput import ThroughputMonitor

__all__ = ["HFExport", "MemoryMonitor", "ThroughputMonitor"]
