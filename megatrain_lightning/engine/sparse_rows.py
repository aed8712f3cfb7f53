"""An untied input embedding's update, split by rows (``split_embedding_update``).

Why: the part the next forward needs first (the input embedding: 0.55 B parameters at 7B) is updated
between one step's backward and the next forward, where the device waits for it (its gradient comes last in
the backward). But an untied embedding's gradient is zero outside the rows the step looked up (a few
thousand of 152 K at 32 K tokens), and Adam's update of a row with a zero gradient (the moments decay, the
weight decays) needs no gradient. So:

* **first half**, once the backward has begun (the lookups are known): every row is updated with a zero
  gradient, on the host worker beside the blocks' updates, after the looked-up rows' weights and moments
  were set aside (``StoreUpdate.rows_first``);
* **second half**, at the end of the backward: only the looked-up rows' gradients come home (gathered on the
  device), and those rows are updated from their set-aside state (``StoreUpdate.rows_last``).

Bit for bit the whole update (elementwise kernel, pieces aligned as a whole-table call's). A run-time check
guards the assumption: if the gradient has any value outside the looked-up rows (the weight is used
elsewhere too), the second half raises instead of training wrongly.

Scope: the resident part before the blocks holds this one table and nothing else, a single ``nn.Embedding``
owns it (not tied to the head), fp32 host state, its width a multiple of 16, one lookup per step and an
update that overlaps the backward (one micro-batch per optimizer step). Otherwise the engine updates the
table whole, as before.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable

import torch

from .host_store import FlatStore, PinnedRegistry
from .host_worker import HostWorker

ZERO_CHUNK = 1 << 22  # elements of the shared zero gradient of the first half's pieces (16 MB)


class SplitRows:
    """Runs one table's update in two halves per step (see the module docstring).

    Buffer lifetimes: ``mask_host`` and ``rows_host`` (pinned) are written by this step's copies and read
    by its jobs; the next step writes them again only after the next forward awaited this step's second
    half (the table's update future). Device temporaries are tied to the copy stream (``record_stream``).
    """

    def __init__(self, store: FlatStore, pins: PinnedRegistry, streams: Any, worker: HostWorker, device: torch.device) -> None:
        self.store = store
        self.param = store.params[0]
        self.rows, self.width = self.param.shape
        self.pins = pins
        self.streams = streams
        self.worker = worker
        self.device = device
        self.mask_host = pins.empty(self.rows, torch.bool)
        self.flag_host = pins.empty(1, torch.bool)
        self.rows_host: torch.Tensor | None = None  # [capacity, width] fp32, grown on need
        self.zero = torch.zeros(ZERO_CHUNK)
        self._ids: torch.Tensor | None = None
        self._lookups = 0
        self._mask: torch.Tensor | None = None
        self._first: Future | None = None
        self.steps = 0  # steps updated this way, over the run (tests and logs)

    @staticmethod
    def eligible(store: FlatStore, owners: list[torch.nn.Module]) -> bool:
        p = store.params
        return (
            len(p) == 1 and not store.compact and len(owners) == 1 and isinstance(owners[0], torch.nn.Embedding)
            and p[0].dim() == 2 and p[0].shape[1] % 16 == 0
        )

    # ------------------------------------------------------------------ forward
    def looked_up(self, ids: torch.Tensor) -> None:
        """The embedding's forward ran on ``ids`` (device tensor) in a training step."""
        self._ids = ids
        self._lookups += 1

    def reset(self) -> None:
        """A new micro-batch: forget the last one's lookups (its halves, if any, were submitted)."""
        self._ids, self._lookups, self._mask, self._first = None, 0, None, None

    # ------------------------------------------------------------------ backward
    def begin(self, update: Any, priority: int) -> bool:
        """The backward has begun: submit the first half (False: this step updates the table whole)."""
        if (
            self._lookups != 1 or self._ids is None or not self.param.requires_grad or self.param.grad is not None
            or not hasattr(update, "can_split_rows") or not update.can_split_rows(self.store)
        ):
            return False
        compute = self.streams.compute()
        with torch.no_grad():
            mask = torch.zeros(self.rows, dtype=torch.bool, device=self.device)
            mask.index_fill_(0, self._ids.reshape(-1), True)  # no host sync
        ready = self.streams.event()
        ready.record(compute)
        with self.streams.on(self.streams.d2h):
            self.streams.wait(self.streams.d2h, ready)
            self.mask_host.copy_(mask, non_blocking=True)
            landed = self.streams.event()
            landed.record(self.streams.d2h)
            if self.streams.cuda:
                mask.record_stream(self.streams.d2h)
        self._mask = mask
        self._first = self.worker.submit(priority, self._first_half, landed, update, ready=landed.query)
        return True

    def _first_half(self, landed: Any, update: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        landed.synchronize()  # host worker: the mask has landed
        touched = self.mask_host.nonzero().view(-1)
        return touched, update.rows_first(self.store, touched, self.zero)

    def end(self, grad: torch.Tensor, update: Any, priority: int) -> Future:
        """End of the backward, ``grad`` the table's device gradient: the looked-up rows' gradients home,
        the second half submitted. Returns its future (the table's update)."""
        assert self._mask is not None and self._first is not None and self._ids is not None
        mask, first = self._mask, self._first
        k_max = min(self.rows, self._ids.numel())
        if self.rows_host is None or self.rows_host.shape[0] < k_max:
            self.rows_host = self.pins.empty(k_max * self.width).view(k_max, self.width)
        compute = self.streams.compute()
        with torch.no_grad():
            outside = mask.logical_not()
            order = torch.argsort(outside.to(torch.uint8), stable=True)[:k_max]  # looked-up rows first, ascending
            rows = grad.index_select(0, order)
            stray = (grad.ne(0).any(dim=1) & outside).any().reshape(1)
        ready = self.streams.event()
        ready.record(compute)
        rows_host = self.rows_host[:k_max]
        with self.streams.on(self.streams.d2h):
            self.streams.wait(self.streams.d2h, ready)
            rows_host.copy_(rows, non_blocking=True)
            self.flag_host.copy_(stray, non_blocking=True)
            landed = self.streams.event()
            landed.record(self.streams.d2h)
            if self.streams.cuda:
                rows.record_stream(self.streams.d2h)
                stray.record_stream(self.streams.d2h)
        self.steps += 1
        self.reset()
        ready_fn: Callable[[], bool] = lambda: first.done() and landed.query()  # noqa: E731
        return self.worker.submit(priority, self._second_half, landed, first, rows_host, update, ready=ready_fn)

    def _second_half(self, landed: Any, first: Future, rows_host: torch.Tensor, update: Any) -> None:
        landed.synchronize()  # host worker: the rows' gradients have landed
        touched, saved = first.result()
        if bool(self.flag_host[0]):
            raise RuntimeError(
                "split_embedding_update: the input embedding's gradient has values outside the rows its "
                "forward looked up, so the weight is used elsewhere too (tied to a head, or read by the "
                "loss): this step's update is wrong. Pass MegaTrainStrategy(split_embedding_update=False)."
            )
        update.rows_last(self.store, touched, rows_host[: touched.numel()], saved)
