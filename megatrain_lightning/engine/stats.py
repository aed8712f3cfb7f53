"""What the engine counts over a run: copies per store, pooled and bf16 gradient sends, host waits.

Read by tests, logs and the benchmark's per-step diagnostics; nothing in the data flow depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Counters since the engine was built (or :meth:`reset`).

    ``h2d``/``reused``/``d2h`` are keyed by block index, or ``RESIDENT``/``RESIDENT_AFTER`` for the
    resident parts: how often each store's weights were loaded into a slot (from the host, or a block's
    from its masters updated on the device), were reused in a slot already
    holding them, and how often its gradients came back.
    """

    h2d: dict[int, int] = field(default_factory=dict)
    reused: dict[int, int] = field(default_factory=dict)
    d2h: dict[int, int] = field(default_factory=dict)
    grads_lent: int = 0  # pooled gradient buffers lent (grad_buffers)
    half_sent: int = 0  # stores whose gradients travelled as bf16 (bf16_grads)
    update_wait_s: float = 0.0  # host seconds the thread feeding the device waited for host updates

    @staticmethod
    def bump(table: dict[int, int], key: int) -> None:
        table[key] = table.get(key, 0) + 1

    def reset(self) -> None:
        self.h2d, self.reused, self.d2h = {}, {}, {}
        self.grads_lent, self.half_sent, self.update_wait_s = 0, 0, 0.0
