"""Framework-free streaming core: host store, device slots, the streamed-block Function, the pipeline.

Nothing in this subpackage imports Lightning (a test checks it).
"""

from .host_store import FlatLayout, FlatStore
from .pipeline import RESIDENT, CopyCounters, StreamingEngine

__all__ = ["FlatLayout", "FlatStore", "StreamingEngine", "CopyCounters", "RESIDENT"]
