"""Framework-free streaming core: nothing in this subpackage imports Lightning (a test checks it).

Modules, in the order data flows through them: ``layout`` and ``store`` (flat host buffers), ``materialize`` (meta
models built into the store), ``streams``, ``slots`` and ``prefetch`` (weights onto the device), ``block``,
``selective`` and ``side_outputs`` (the streamed-block autograd Function, what it records), ``first_call`` and
``wide_weights`` (what a block's checked first call refuses, and the weights it finds to hold in fp32), ``offload``
(saved inputs parked on the host), ``resident`` (embeddings and head), ``grads`` (gradients home), ``host_worker`` and
``updates`` (the host jobs and the updates in flight), ``phase`` and ``stats``; ``engine`` wires them.
"""

from .engine import StreamingEngine
from .phase import Phase
from .resident import RESIDENT, RESIDENT_AFTER
from .layout import FlatLayout
from .stats import EngineStats
from .store import FlatStore

__all__ = ["StreamingEngine", "Phase", "EngineStats", "FlatLayout", "FlatStore", "RESIDENT", "RESIDENT_AFTER"]
