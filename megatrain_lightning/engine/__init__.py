"""Framework-free streaming core: host store, device slots, the streamed-block Function, the pipeline.

Nothing in this subpackage imports Lightning (a test checks it).
"""

from .host_store import FlatLayout, FlatStore
from .pipeline import CopyCounters, StreamingEngine
from .resident import RESIDENT, RESIDENT_AFTER

__all__ = ["FlatLayout", "FlatStore", "StreamingEngine", "CopyCounters", "RESIDENT", "RESIDENT_AFTER"]
