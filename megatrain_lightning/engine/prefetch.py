"""Block weights onto the device: slots filled ahead of use, in the predicted call order.

One micro-batch acquires block weights in a predictable order: the forward calls, then the recomputes in
reverse (kept blocks skip theirs). The order of the last micro-batch predicts the next; each acquire
advances a cursor through it and tops the slots up with the next blocks, so that a block's copy runs on
the host->device stream while earlier blocks compute. Slot lifetime: a copy into a slot waits (on the
device) for that slot's ``free`` event, recorded on compute after the last kernel that reads it was
queued; compute waits for the slot's ``ready`` event before reading it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .slots import DeviceSlots
from .stats import EngineStats
from .store import FlatStore
from .streams import Streams

# wait_for(block, block=...) -> whether the block's update has run (UpdateTracker.wait_for)
UpdateGate = Callable[..., bool]


class WeightStream:
    """Acquires and releases block weights in device slots, prefetching the ones about to run."""

    def __init__(self, stores: Sequence[FlatStore], slots: DeviceSlots, streams: Streams, stats: EngineStats,
                 keep: set[int], update_done: UpdateGate,
                 ahead: Callable[[int], torch.Tensor | None] = lambda block: None) -> None:
        self.stores = list(stores)
        self.ahead = ahead  # a block's device masters where newer than the host's (device_update.ahead)
        self.slots = slots
        self.streams = streams
        self.stats = stats
        self.keep = keep
        self.update_done = update_done
        n_slots = len(slots.buffers)
        self._ready = [streams.event() for _ in range(n_slots)]
        self._free = [streams.event() for _ in range(n_slots)]
        self._used = [False] * n_slots
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._refreshed: dict[int, int] = {}  # block -> the slot its update on the device wrote (refresh)
        self.recorded: list[int] = list(range(len(self.stores)))  # the forward calls of the last micro-batch
        self.order: list[int] = self.call_order(self.recorded)
        self.pos = 0

    def call_order(self, forward: list[int]) -> list[int]:
        """Weight acquisitions of one micro-batch: the forward calls, then the recomputes in reverse."""
        return forward + [b for b in reversed(forward) if b not in self.keep]

    def learn(self, recorded: list[int]) -> None:
        """The micro-batch that just ended called blocks in ``recorded`` order: predict the next from it."""
        if recorded:
            self.recorded = list(recorded)
            self.order = self.call_order(self.recorded)
        self.pos = 0

    def start(self) -> None:
        """A step begins: the first blocks start streaming in."""
        self.pos = 0
        self._prefetch(current=None)

    def acquire(self, block: int) -> list[torch.Tensor]:
        """Weights of ``block`` in a device slot, ready for the compute stream (a device-side wait)."""
        try:
            self.pos = self.order.index(block, self.pos) + 1
        except ValueError:
            pass
        s = self.slots.slot_of(block)
        if s is None:
            s = self._load(block, protect={block})
            assert s is not None
        elif self._used[s]:
            self.stats.bump(self.stats.reused, block)
        self._used[s] = True
        self.streams.wait(self.streams.compute(), self._ready[s])
        self._prefetch(current=block)
        key = (block, s)
        if key not in self._views:
            store = self.stores[block]
            self._views[key] = store.layout.views(self.slots.buffers[s], self.slots.wide[s], self._narrow(store))
        return self._views[key]

    def _narrow(self, store: FlatStore) -> tuple[int, torch.dtype] | None:
        """Where a slot holds ``store``'s frozen weights in their own, narrower dtype: (start, dtype) of its
        frozen region, in an fp32 slot ("32-true") for bf16/fp16 frozen weights (a frozen bf16 teacher, a bf16
        base under adapters compute in bf16, as under the default strategy); else None (cast to the slot's)."""
        dtype = store.frozen.dtype
        if self.slots.dtype != torch.float32 or dtype == torch.float32 or store.numel <= store.train_numel:
            return None
        return store.train_numel, dtype

    def release(self, block: int) -> None:
        """The kernels reading ``block``'s slot are queued: it may be refilled once they have run."""
        s = self.slots.slot_of(block)
        if s is not None:
            self._free[s].record(self.streams.compute())

    def _prefetch(self, current: int | None) -> None:
        window: list[int] = []
        for b in self.order[self.pos : self.pos + self.slots.depth - (0 if current is None else 1)]:
            if b not in window:
                window.append(b)
        protect = set(window) | ({current} if current is not None else set())
        for b in window:
            if self.slots.slot_of(b) is None:
                if b not in self.slots.fixed and self._free_slot(protect) is None:
                    return
                if self._load(b, protect, wait=False) is None:
                    return  # its update is still running: the next acquire tries again

    def _free_slot(self, protect: set[int]) -> int | None:
        """A rotating slot to load into: an empty one, else one whose block is not about to run."""
        held = self.slots.block_in_slot[: self.slots.depth]
        for s, b in enumerate(held):
            if b is None:
                return s
        for s, b in enumerate(held):
            if b not in protect:
                return s
        return None

    def _load(self, block: int, protect: set[int], wait: bool = True) -> int | None:
        """Copy ``block``'s weights into a slot once its update (if one runs on) has run; without ``wait``,
        None instead of waiting for that."""
        if not self.update_done(block, block=wait):
            return None
        s = self.slots.fixed.get(block)
        if s is None:
            s = self._free_slot(protect)
        if s is None:
            raise RuntimeError("no free device slot: raise EngineConfig.slots")
        store = self.stores[block]
        h2d = self.streams.h2d
        with self.streams.on(h2d):
            self.streams.wait(h2d, self._free[s])  # slot lifetime: no queued kernel still reads it
            slot, wide = self.slots.buffers[s], self.slots.wide[s]
            newer = self.ahead(block)  # its update on the device ran (update_done), its masters stayed there
            narrow = self._narrow(store)
            for src, a, b in store.regions():  # trainable masters, then frozen weights in their own dtype
                stage = self.slots.staging_for(src.dtype)
                if narrow is not None and a == narrow[0]:  # kept in their dtype: no cast
                    store.layout.narrow_region(slot, a, src.dtype).copy_(src, non_blocking=True)
                    continue
                if newer is not None and src is store.master:
                    # cast from the device masters, as refresh() casts them: nothing crosses the link
                    slot[a:b].copy_(newer)
                    stage = newer
                elif stage is None:
                    slot[a:b].copy_(src, non_blocking=True)
                else:
                    stage[a:b].copy_(src, non_blocking=True)
                    slot[a:b].copy_(stage[a:b])  # cast to the compute dtype on the device
                if wide is not None:  # one-dimensional weights in fp32: from the staged masters where staged
                    dst, from_ = store.layout.wide_pairs(wide, slot if stage is None else stage, a, b)
                    if dst:
                        torch._foreach_copy_(dst, from_)
            self._ready[s].record(h2d)
        self.slots.block_in_slot[s] = block
        self._used[s] = False
        self.stats.bump(self.stats.h2d, block)
        return s

    def refresh(self, block: int, master: torch.Tensor) -> None:
        """Compute stream: ``block``'s trainable weights, updated on the device (``device_update.py``) as
        fp32 ``master``, into the slot the backward read them from, cast as a copy from the host would be.
        The slot holds them through the next :meth:`invalidate` (the optimizer step that made them)."""
        s = self.slots.slot_of(block)
        assert s is not None
        store = self.stores[block]
        slot, wide = self.slots.buffers[s], self.slots.wide[s]
        slot[: store.train_numel].copy_(master)  # the frozen region is as the backward read it
        if wide is not None:
            dst, src = store.layout.wide_pairs(wide, master, 0, store.train_numel)
            if dst:
                torch._foreach_copy_(dst, src)
        compute = self.streams.compute()
        self._ready[s].record(compute)
        self._free[s].record(compute)  # slot lifetime: a later copy into it waits for these writes too
        self._refreshed[block] = s

    def invalidate(self) -> None:
        """The masters changed: no slot holds current weights any more, but for the slots a block's update
        on the device wrote since the last call (they hold what the host masters become)."""
        kept = {s: b for b, s in self._refreshed.items() if self.slots.block_in_slot[s] == b}
        self._refreshed = {}
        self.slots.invalidate()
        for s, b in kept.items():
            self.slots.block_in_slot[s] = b

    def relaid(self, block: int) -> None:
        """``block``'s store was laid out again: its views of the slots are rebuilt on next use."""
        self._views = {k: v for k, v in self._views.items() if k[0] != block}
        self._refreshed = {}
        self.slots.invalidate()

    def close(self) -> None:
        self.slots.close()
        self._views = {}
