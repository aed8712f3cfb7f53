"""The streaming engine: host store, device slots, three streams, a gradient path and a host worker.

Data flow of one micro-batch (see DESIGN.md section 4):

* forward: block ``i`` waits for its weights in a slot (``ready`` event), runs without keeping
  activations, marks the slot free (``free`` event); meanwhile the host→device stream fills the other
  slots with the next blocks of the predicted call order.
* backward: blocks in reverse; each is recomputed from its saved input with re-streamed weights, its
  parameter gradients are packed into one flat device slab (fp32) and go to the host in one copy on the
  device→host stream, straight into the pinned fp32 accumulator when nothing is pending there, else into
  a pinned staging buffer that the host worker thread adds in once the copy's event has completed.
* the resident parameters (everything outside the blocks) live on the device during a step, as fp32
  copies of their host masters, in two parts (``resident.py``): those used before the blocks go back at
  the end of the backward; those used only after them (final norm, untied head) at its first block.
* options that spend device memory for speed: kept blocks (``keep_activations``) build their graph in
  the forward and skip the recompute; cached blocks (``cache_weights``) own a fixed slot filled once per
  optimizer step. One that spends link bytes for device memory: ``offload_inputs`` parks the saved
  inputs in pinned host memory (d2h stream) and brings each back one block ahead (h2d stream).
* a block whose update runs as soon as its gradients land, with nothing to accumulate, borrows one of
  ``grad_buffers`` pooled pinned buffers for them instead of a full-size accumulator of its own.

Ordering is by events only; the one host synchronisation per micro-batch is at the end of the backward,
where the host optimizer needs the gradients. On a machine without CUDA the same code runs with the
CPU as the device: copies are plain copies, streams and events are no-ops, and the worker thread is
ordered by futures.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Literal, Sequence

import torch
from torch import nn

from .device_slots import BlockBinding, DeviceSlots
from .host_store import FlatLayout, FlatStore, HostState, PinnedRegistry
from . import native_adam
from .host_worker import HostWorker
from .materialize import InitFn, MetaMaterializer
from .resident import RESIDENT, RESIDENT_AFTER, ResidentPart, resident_names
from .sparse_rows import SplitRows
from .streamed_block import CallSpec, StreamedBlock

KeptSaves = Literal["all", "matmuls"]
KEPT_SAVES: tuple[str, ...] = ("all", "matmuls")


class _NoEvent:
    """Stands in for ``torch.cuda.Event`` on the CPU, where every copy has completed when it returns."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Streams:
    """Compute (the caller's current stream), host→device and device→host streams; no-ops on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = torch.cuda.Stream(device) if self.cuda else None

    def event(self) -> Any:
        return torch.cuda.Event() if self.cuda else _NoEvent()

    def compute(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def wait(self, waiter: Any, event: Any) -> None:
        """Make ``waiter`` (a stream) wait for ``event``: device-side, the host does not block."""
        if self.cuda:
            waiter.wait_event(event)


@dataclass
class CopyCounters:
    """How often each block's weights went to the device, were reused there, and its gradients came back.

    Keys are block indices, ``RESIDENT`` and ``RESIDENT_AFTER`` for the resident parameters.
    """

    h2d: dict[int, int] = field(default_factory=dict)
    reused: dict[int, int] = field(default_factory=dict)
    d2h: dict[int, int] = field(default_factory=dict)

    def bump(self, table: dict[int, int], key: int) -> None:
        table[key] = table.get(key, 0) + 1


# Elements per range of a pipelined resident update (see RangedUpdate): 128 MB of fp32, a few ms on the
# link each way and ~8 ms of AdamW on the 16-core H200 host.
RANGE_ELEMS = 1 << 25


class RangedUpdate:
    """A store's update done range by range, each range signalled as soon as it is updated.

    Why: the resident part before the blocks (input embedding, tied head) is updated between one step's
    backward and the next forward, where the device waits for it. Whole, that is its gradients' copy to
    the host, then the AdamW, then its weights' copy back (0.31 B params at 3B: ~22 + 80 + 22 ms).
    Range by range, range j's AdamW runs while range j+1's gradients come in and range j-1's weights go
    out: ~3 + 80 + 3 ms.

    ``bounds``: 0 = b0 < b1 < ... < bk = numel, multiples of 16 (``StoreUpdate.range`` needs them so).
    Buffer lifetime: the master range ``[b(j), b(j+1))`` may be copied to the device once ``done[j]`` is
    set; every signal is set when the job ends, failed or not (the future then says which). ``whole``:
    the update was not split after all (wait for its future, as for any store).
    """

    def __init__(self, numel: int, range_elems: int) -> None:
        step = max(16, range_elems // 16 * 16)
        self.bounds = list(range(0, numel, step)) + [numel]
        self.done = [threading.Event() for _ in range(len(self.bounds) - 1)]
        self.whole = False  # set by the gradient path when the update could not be split

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.bounds[:-1], self.bounds[1:]))

    def release(self) -> None:
        for e in self.done:
            e.set()


class _GradPath:
    """Device slabs → pinned host memory → fp32 accumulators, for blocks and resident parameters."""

    def __init__(
        self,
        streams: _Streams,
        numel: int,
        device: torch.device,
        pins: PinnedRegistry,
        pool_buffers: int = 0,
        pool_numel: int = 0,
        threads: int | None = None,
        half: bool | None = False,
    ) -> None:
        self.streams = streams
        # bf16 gradients bound for an update travel as bf16 (see send); None: where the one-pass kernel
        # builds, asked at the first bf16 gradient (an fp32 run never builds it)
        self.half = half
        self.numel = numel
        self.device = device
        self.pins = pins
        # Two device slabs: block i's slab is overwritten by block i+2 only after its D2H copy finished.
        self.slabs = [torch.empty(numel, device=device) for _ in range(2)]
        self.slab_done = [streams.event() for _ in range(2)]
        self.slab_written = [streams.event() for _ in range(2)]
        self.turn = 0
        # Pinned staging for accumulation, allocated on first need; each has the future of its last use.
        self.staging: list[torch.Tensor] = []
        self.staging_busy: list[Future | None] = []
        self.staging_turn = 0
        self._staged = 0
        self.busy: dict[int, Future] = {}
        self.worker = HostWorker(threads=threads)
        self.pending: list[Future] = []  # gradient accumulation jobs
        self.updates: list[Future] = []  # overlapped optimizer updates
        # Pooled gradient buffers: a store whose update runs as soon as its gradients land (and that
        # holds no gradient to add to) borrows one instead of keeping a full-size accumulator of its own.
        # Buffer lifetime: from the store's device→host copy to the end of its update on the worker.
        self.pool_buffers = pool_buffers
        self.pool_numel = pool_numel
        self.pool_free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self.pool_made = 0
        self.lent = 0  # buffers lent over the run (for tests and logs)
        self.half_sent = 0  # stores whose gradients travelled as bf16 (for tests and logs)

    def send(
        self,
        store: FlatStore,
        grads: Sequence[torch.Tensor | None],
        then: Callable[[FlatStore], None] | None = None,
        priority: int = 0,
        ranged: RangedUpdate | None = None,
    ) -> Future | None:
        """Ship one store's gradients (layout order, ``None`` where a parameter got none) to the host.

        ``then(store)`` runs on the host worker once they are in host memory (the overlapped optimizer
        update of that store); its future is returned. ``priority``: the store's place in the next
        forward (see ``host_worker.py``).

        Three ways in: bf16 gradients that go straight into ``then`` (every parameter has one, none holds
        one: ``FlatStore.hold_half_grad``) travel as they are, at half the bytes; otherwise they are
        widened to fp32 on the device and land in the fp32 accumulator (directly when it holds nothing
        that must be kept), or in pinned staging that the worker adds in.

        ``ranged``: when the gradients land directly and ``then.range`` can update this store, copy and
        update them range by range (:class:`RangedUpdate`); else it is marked ``whole``.
        """
        layout = store.layout
        n = layout.numel
        k = self.turn
        self.turn ^= 1
        empty = all(p.grad is None for p in layout.params)
        half = (
            self.half is not False
            and then is not None
            and empty
            and all(g is not None and g.dtype == torch.bfloat16 for g in grads)
            and not self._busy(store)
        )
        if half and self.half is None:
            self.half = half = native_adam.kernel() is not None
        # the two device slabs are fp32; a bf16 store's gradients use the first half of one's bytes
        slab = self.slabs[k].view(torch.bfloat16)[:n] if half else self.slabs[k][:n]
        compute = self.streams.compute()
        # Slab lifetime: wait (on the device) until the previous D2H copy out of this slab has finished.
        self.streams.wait(compute, self.slab_done[k])
        slab.zero_()  # padding and absent gradients must read as zeros on the host
        present = [(v, g) for v, g in zip(layout.views(slab), grads) if g is not None]
        if present:
            torch._foreach_copy_([v for v, _ in present], [g for _, g in present])  # casts bf16 -> fp32 (not if half)
        self.slab_written[k].record(compute)

        lent = None
        if then is not None and store.grad is None and empty:
            lent = self._lend(store, half)
        if half:
            target = store.hold_half_grad(lent)
            direct = True
            self.half_sent += 1
        else:
            host = store.grad_buffer()
            # Straight into the accumulator only when it holds nothing that must be kept.
            direct = empty and not self._busy(store)
            target = host[:n] if direct else self._take_staging(n)
        fresh = [g is not None and p.grad is None for p, g in zip(layout.params, grads)]
        held = [p.grad is not None for p in layout.params]
        assert lent is None or direct  # a lent buffer holds nothing yet: its store's copy lands straight in it
        # One event per copy: the worker must wait for *this* copy, not a later reuse of the slab.
        update_range = getattr(then, "range", None)
        if ranged is not None and not (
            direct and not half and lent is None and update_range is not None and then.can_range(store)
        ):
            ranged.whole = True  # updated whole, as any other store: its weights go once the future is done
            ranged = None
        done = self.slab_done[k] = self.streams.event()
        landed: list[Any] = []
        with self.streams.on(self.streams.d2h):
            self.streams.wait(self.streams.d2h, self.slab_written[k])
            if ranged is None:
                target.copy_(slab, non_blocking=True)
            else:
                for a, b in ranged.ranges():  # one copy and one event per range
                    target[a:b].copy_(slab[a:b], non_blocking=True)
                    landed.append(self.streams.event())
                    landed[-1].record(self.streams.d2h)
            done.record(self.streams.d2h)
        if not half:
            # Attach before the worker may look: the overlapped update reads ``p.grad``.
            for p, view, f in zip(layout.params, store.grad_views, fresh):
                if f:
                    p.grad = view
        if not direct:
            fut = self.worker.submit(priority, self._accumulate, done, store, target, fresh, held, ready=done.query)
            self.staging_busy[self._staged] = fut
            self.busy[id(store)] = fut
            self.pending.append(fut)
            if then is not None:  # a job of its own, so that draining the gradients does not wait for it
                fut = self.worker.submit(priority, then, store, ready=fut.done)  # after the add
                self._track(fut)
                return fut
        elif ranged is not None:
            fut = self.worker.submit(priority, self._ranged_update, landed, store, update_range, ranged, ready=landed[0].query)
            self._track(fut)
            return fut
        elif then is not None:
            fut = self.worker.submit(
                priority, self._after_copy, done, store, then, lent, self.pool_free, half, ready=done.query
            )
            self._track(fut)
            return fut
        return None

    @staticmethod
    def _ranged_update(
        landed: list[Any], store: FlatStore, update_range: Callable[[FlatStore, int, int], None], ranged: RangedUpdate
    ) -> None:
        """Host worker: range j's update once its gradients' copy has landed, then its signal."""
        try:
            for j, (a, b) in enumerate(ranged.ranges()):
                landed[j].synchronize()  # host worker: this range's D2H copy has landed
                update_range(store, a, b)
                ranged.done[j].set()
        finally:
            ranged.release()  # a failure must not leave the device-feeding thread waiting

    def _track(self, fut: Future) -> None:
        """Keep ``fut`` for :meth:`wait_updates`. Updates that run on into the next step are never waited
        for in bulk, so finished ones are dropped here (failed ones stay, to raise there)."""
        self.updates = [f for f in self.updates if not f.done() or f.exception() is not None]
        self.updates.append(fut)

    def _lend(self, store: FlatStore, half: bool = False) -> torch.Tensor | None:
        """A pooled buffer for ``store``'s gradients, or None (no pool, or the store is larger). With
        ``half`` the caller reads it as bf16 (``FlatStore.hold_half_grad``), else it becomes ``store.grad``."""
        if self.pool_buffers == 0 or store.numel > self.pool_numel:
            return None
        try:
            buf = self.pool_free.get_nowait()
        except queue.Empty:
            if self.pool_made < self.pool_buffers:
                buf = self.pins.empty(self.pool_numel)
                self.pool_made += 1
            else:
                # Host wait: every buffer is lent to a queued update; the worker returns one when an
                # update is done (the device runs ahead by `pool_buffers` blocks at most).
                buf = self.pool_free.get()
        if not half:
            store.lend_grad(buf)
        self.lent += 1
        return buf

    def _busy(self, store: FlatStore) -> bool:
        fut = self.busy.get(id(store))
        return fut is not None and not fut.done()

    def _take_staging(self, n: int) -> torch.Tensor:
        if not self.staging:
            self.staging = [self.pins.empty(self.numel) for _ in range(2)]
            self.staging_busy = [None, None]
        j = self._staged = self.staging_turn
        self.staging_turn ^= 1
        busy = self.staging_busy[j]
        if busy is not None:
            busy.result()  # host wait: the worker must have consumed this staging buffer
        return self.staging[j][:n]

    @staticmethod
    def _after_copy(
        done: Any,
        store: FlatStore,
        then: Callable[[FlatStore], None],
        lent: torch.Tensor | None,
        pool: "queue.SimpleQueue[torch.Tensor]",
        half: bool = False,
    ) -> None:
        done.synchronize()  # host worker: the D2H copy into the accumulator has landed
        try:
            then(store)
        finally:
            # Buffer lifetime: the update has read the gradients; bf16 ones are let go, a lent buffer
            # goes back to the pool.
            if half:
                store.drop_half_grad()
            elif lent is not None:
                store.return_grad()
            if lent is not None:
                pool.put(lent)

    @staticmethod
    def _accumulate(
        done: Any,
        store: FlatStore,
        staged: torch.Tensor,
        fresh: list[bool],
        held: list[bool],
    ) -> None:
        """Host worker: add (or, for parameters whose ``.grad`` was None, copy) a staged gradient."""
        done.synchronize()  # the worker waits for the D2H copy, the thread feeding the GPU does not
        assert store.grad is not None
        if not any(fresh):
            store.grad[: staged.numel()].add_(staged)  # one flat add; absent gradients are zeros
        else:
            for view, src, f, h in zip(store.grad_views, store.layout.views(staged), fresh, held):
                if f:
                    view.copy_(src)
                elif h:
                    view.add_(src)

    def drain(self) -> None:
        """Host sync point: every gradient of this backward is in its fp32 accumulator after this."""
        if self.streams.cuda:
            self.streams.d2h.synchronize()
        for fut in self.pending:
            fut.result()
        self.pending.clear()
        self.busy.clear()

    def wait_updates(self) -> None:
        """Host sync point: every overlapped optimizer update has run (and raised, if it failed)."""
        for fut in self.updates:
            fut.result()
        self.updates.clear()

    def close(self) -> None:
        self.drain()
        self.wait_updates()
        self.worker.shutdown()


class StreamingEngine:
    """Streams ``blocks`` through ``slots`` device buffers; everything else is resident during a step.

    Args:
        root: the whole model. Its parameters outside ``blocks`` are resident: on the device during a
            step (fp32 copies of their host masters), on the host otherwise.
        blocks: the repeated blocks of ``root``, in their usual forward order. Their ``forward`` is
            replaced by a streaming one for the engine's lifetime (:meth:`close` restores it).
        device: the compute device; the CPU runs the very same path (copies are plain copies).
        compute_dtype: dtype of the block weights on the device. ``torch.bfloat16`` halves slot memory
            and runs matmuls on tensor cores; masters and gradients stay fp32 on the host either way.
        slots: device weight buffers (>= 2). More slots prefetch deeper; each costs one block of memory.
        pin_memory: pin the host masters and gradient accumulators (exact size) so copies run at full
            link speed; only meaningful with CUDA. ``None``: pin when the device is CUDA.
        init: fills the tensors of modules built on the meta device, which the engine materialises
            block by block straight into the host store (see ``materialize.py``). Required only when
            the model holds meta tensors.
        keep_activations: the last ``keep_activations`` blocks (in forward order) keep their activations
            on the device from forward to backward instead of being recomputed, and keep their weights in
            a fixed device slot. Costs one block's activations (for a 7B layer at 16 K tokens ~3.5 GB) plus
            its weights per kept block; saves a third of its device work and two weight copies. The last
            blocks are the ones to keep: their backward comes first, while the copies for the recomputed
            ones are being issued.
        host_threads: intra-op threads of the host worker (gradient adds, AdamW); ``None``: torch's
            default (all cores). Fewer leave cores to the thread that launches the GPU's work; on the
            16-core H200 host, 15 instead of 16 made the 3B step slower (1.10 s against 1.05 s), so the
            AdamW's memory bandwidth matters more there than the launching thread's core.
        kept_saves: what a kept block holds for its backward. ``"all"``: every activation autograd saves.
            ``"matmuls"``: its input and the outputs of its matmuls and attention only; the backward
            recomputes the elementwise ops (norms, rotary, activation, residual adds) from them, a few
            percent of the block's time (``selective.py``). Less than half the memory per kept block,
            so about twice as many blocks can be kept in the same device memory.
        split_embedding_update: update an untied input embedding in two halves (``sparse_rows.py``): every
            row with a zero gradient while the backward runs, then only the rows the step looked up, so
            that little of it is left between the backward and the next forward. Exact; applies when the
            resident part before the blocks is that one table, one lookup per step, the update overlapping
            the backward; raises if the table's gradient turns out not to be row-sparse.
        bf16_grads: a block computed in bf16 whose gradients go straight into its overlapped update (no
            accumulation, no ``.grad`` to keep) sends them home in bf16, where the update widens them:
            the same result bit for bit (a bf16 gradient widens to fp32 exactly), half the device→host
            bytes and 2 B/param of pinned host buffer instead of 4. ``None`` (default): on where the
            one-pass kernel (``native_adam``) builds, which widens in a register (26 host bytes/param
            instead of 28; 3B on the H200: 1.005 against 1.16 s/step); off without it, where the
            widening is a pass of its own per chunk and costs more than it saves (1.29 against 1.12 s).
            Such blocks' ``.grad`` stay None.
        cache_weights: the last ``max(cache_weights, keep_activations)`` blocks keep their compute-dtype
            weights in fixed device slots for the whole optimizer step: one host→device copy per step
            instead of two per micro-batch, for one block of weights each (a 7B layer: 0.47 GB in bf16).
            Host memory bandwidth saved this way is bandwidth the host optimizer gets.
        offload_inputs: keep the saved inputs of recomputed blocks in pinned host memory instead of on
            the device; they come back one block ahead of their backward on the host→device stream. Device
            memory then no longer grows with depth (each saved input is one activation of the residual
            stream: tokens x hidden x 4 bytes); it costs their bytes on the link both ways.
        host_state: ``"fp32"`` (16 B/param: fp32 master, gradient, Adam moments) or ``"compact"`` (12 B:
            the fp32 master split into a bf16 high half, which is what the device receives, and an int16
            low half; bf16 moments; fp32 gradient). See ``host_store.py``; Adam/AdamW only.
        grad_buffers: pinned fp32 gradient buffers (one block each) lent to blocks whose optimizer update
            runs as soon as their gradients land (``on_grads_final``) and that accumulate nothing: such a
            step needs no full-size gradient accumulator (4 B/param) on the host, only these. A block's
            ``.grad`` is released (None) once its update has read it. Blocks that accumulate, or are
            stepped after the backward, get their own accumulator on first need. 0: always their own.
            The device runs at most this many blocks ahead of the host optimizer, and the next forward can
            hide at most this many blocks' updates. ``None``: own accumulators when they (and the Adam
            moments still to come) fit in the host memory available now with a tenth of the total to
            spare (the faster: 1.10 against 1.22 s per 3B step on the H200 host), else 4.
    """

    def __init__(
        self,
        root: nn.Module,
        blocks: Sequence[nn.Module],
        device: torch.device,
        compute_dtype: torch.dtype = torch.float32,
        slots: int = 2,
        pin_memory: bool | None = None,
        init: InitFn | None = None,
        keep_activations: int = 0,
        cache_weights: int = 0,
        offload_inputs: bool = False,
        host_state: HostState = "fp32",
        grad_buffers: int | None = 4,
        kept_saves: KeptSaves = "all",
        host_threads: int | None = None,
        bf16_grads: bool | None = None,
        split_embedding_update: bool = False,
    ) -> None:
        n_blocks = len(blocks)
        if kept_saves not in KEPT_SAVES:
            raise ValueError(f"kept_saves={kept_saves!r}: expected one of {KEPT_SAVES}")
        self.kept_saves = kept_saves
        if grad_buffers is not None and grad_buffers < 0:
            raise ValueError(f"grad_buffers={grad_buffers}: a number of pooled gradient buffers, >= 0 (None: automatic)")
        for name, value in (("keep_activations", keep_activations), ("cache_weights", cache_weights)):
            if not 0 <= value <= n_blocks:
                raise ValueError(f"{name}={value}: must lie between 0 and the number of blocks ({n_blocks})")
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.streams = _Streams(self.device)
        self.pins = PinnedRegistry(self.streams.cuda if pin_memory is None else pin_memory)
        materialize = MetaMaterializer(init)
        self.blocks = list(blocks)
        self.stores: list[FlatStore] = []
        self.bindings: list[BlockBinding] = []
        block_ids = {id(b) for b in self.blocks}
        for block in self.blocks:
            # a meta-built block becomes views of its store now, initialised in place
            store = self._materialize_into_stores(block, lambda b=block: [list(b.parameters())], materialize, host_state)[0]
            assert store is not None  # find_blocks returns blocks with parameters
            self.stores.append(store)
            binding = BlockBinding(block, store.params)
            binding.buffers_to(self.device)
            self.bindings.append(binding)
        self.root = root
        names = resident_names(root, self.blocks)
        resident_stores = self._materialize_into_stores(
            root, lambda: [[root.get_parameter(n) for n in group] for group in names], materialize, host_state, block_ids
        )
        # Resident parameters: fp32 device copies, swapped into ``param.data`` during a step.
        self.resident_parts = [
            ResidentPart(key, priority, store)
            for key, priority, store in zip((RESIDENT, RESIDENT_AFTER), (-1, n_blocks), resident_stores)
            if store is not None
        ]
        self.resident_store = resident_stores[0]  # the part used before the blocks (None: no such part)
        self.resident = [p for part in self.resident_parts for p in part.store.params]
        after = [part for part in self.resident_parts if part.key == RESIDENT_AFTER]
        self._after: ResidentPart | None = after[0] if after else None
        self._after_early = True  # cleared for good if a step uses the after part before the last block
        self._backward_began = False  # in this micro-batch's backward
        self._flags = [[p.requires_grad for p in s.params] for s in self.stores]

        max_numel = max(s.numel for s in self.stores)
        self.keep = set(range(n_blocks - keep_activations, n_blocks))
        cached = range(n_blocks - max(keep_activations, cache_weights), n_blocks)
        fixed = [(b, self.stores[b].numel) for b in cached]
        self.slots = DeviceSlots(
            slots, max_numel, compute_dtype, self.device, fixed=fixed, master_dtype=self.stores[0].dtype
        )
        n_slots = len(self.slots.buffers)
        self._ready = [self.streams.event() for _ in range(n_slots)]
        self._free = [self.streams.event() for _ in range(n_slots)]
        self._slot_used = [False] * n_slots
        self.offload_inputs = offload_inputs
        self._stashes: list[_Stash] = []  # saved inputs in host memory, in forward order
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}
        grad_numel = max([max_numel] + [part.store.numel for part in self.resident_parts])
        if grad_buffers is None:
            grad_buffers = 0 if _accumulators_fit(self.all_stores()) else 4
        self.grad_buffers = grad_buffers
        self.grads = _GradPath(
            self.streams, grad_numel, self.device, self.pins, grad_buffers, max_numel, host_threads, bf16_grads
        )
        self.counters = CopyCounters()

        # Predicted call order of one micro-batch (forward, then backward) and the position in it.
        self._order: list[int] = self._call_order(list(range(n_blocks)))
        self._pos = 0
        self._recorded: list[int] = []

        self.in_step = False
        # Set per micro-batch by the caller: run on the host worker when a store's gradients are final.
        self.on_grads_final: Callable[[FlatStore], None] | None = None
        # Futures of the overlapped updates not yet known to have run, by block (RESIDENT, RESIDENT_AFTER:
        # the resident parts). A store's weights go to the device only after its update has run: what lets
        # the updates of one step run on into the next step's forward (``settle(wait=False)``).
        self._updates: dict[int, Future] = {}
        self._claimed: set[int] = set()  # ids of the stores given to ``on_grads_final`` in this step
        self._ranged: dict[int, RangedUpdate] = {}  # updates of _updates done range by range (RESIDENT)
        self.ranged_copies = 0  # ranges copied to the device as soon as updated, over the run (tests, logs)
        self.update_wait_s = 0.0  # host seconds this thread spent waiting for updates to run (diagnostics)
        self._calls: dict[int, int] = {}  # forward calls of each block not yet matched by a backward

        self._original_forwards: dict[int, Callable[..., Any]] = {}
        self._anchor_t: torch.Tensor | None = None
        for i, block in enumerate(self.blocks):
            block.forward = self._make_forward(i, block)  # type: ignore[method-assign]
        # Any module owning a resident parameter pulls its part onto the device when it runs.
        self._owned_parts: dict[int, list[ResidentPart]] = {}
        owners = self._resident_owners()
        self._hooks = [m.register_forward_pre_hook(self._resident_pre_hook) for m in owners]
        # An untied input embedding updated in two halves (sparse_rows.py), when asked for and it applies
        self._split: SplitRows | None = None
        self._split_owner: nn.Module | None = None
        self._split_active = False
        before = [m for m in owners if any(pt.key == RESIDENT for pt in self._owned_parts[id(m)])]
        if split_embedding_update and self.resident_store is not None and SplitRows.eligible(self.resident_store, before):
            self._split = SplitRows(self.resident_store, self.pins, self.streams, self.grads.worker, self.device)
            self._split_owner = before[0]
        if self._after is not None:  # a gradient after the early send would be lost: refuse it loudly
            self._hooks += [p.register_post_accumulate_grad_hook(self._after_grad_landed) for p in self._after.store.params]

    def _materialize_into_stores(
        self,
        module: nn.Module,
        groups_of: Callable[[], list[list[nn.Parameter]]],
        materialize: MetaMaterializer,
        host_state: HostState,
        skip: Collection[int] = (),
    ) -> list[FlatStore | None]:
        """Materialise ``module`` (not descending into ``skip``) and build one store per group of
        ``groups_of()`` (None for an empty group).

        fp32 stores are laid out from the meta shapes first and the meta parameters become views of the
        store's master, so that initialisation writes the store directly (no second copy of anything).
        """
        masters: list[torch.Tensor | None] = []
        for params in groups_of():
            master = None
            if host_state == "fp32" and any(p.is_meta for p in params):
                layout = FlatLayout(params)
                master = self.pins.empty(layout.numel)
                master.zero_()  # alignment padding stays zero
                materialize.place({id(p): v for p, v in zip(params, layout.views(master)) if p.is_meta})
            masters.append(master)
        materialize(module, skip=skip)
        return [FlatStore(params, self.pins, host_state, master=master) if params else None
                for params, master in zip(groups_of(), masters)]

    # ------------------------------------------------------------------ step scope
    def open_step(self) -> None:
        """Enter a step: resident weights go to the device and the first blocks start streaming in."""
        self.in_step = True
        self._pos = 0
        self._recorded = []
        if self._split is not None:
            self._split.reset()
            self._split_active = False
        for part in self.resident_parts:  # the after part only if its update has run (else when used)
            self._ensure_part(part, wait=part.key != RESIDENT_AFTER)
        self._prefetch(current=None)

    def end_call(self) -> None:
        """The user's step function returned; blocks called from now on (outside a step) run on the host."""
        self.in_step = False

    def finish_backward(self) -> None:
        """After ``loss.backward()``: resident gradients home, one host sync, host grads attached.

        Sync point: waits for every device→host gradient copy and the host worker.
        """
        self._resident_to_host(with_grads=True)
        self.grads.drain()
        if self.streams.cuda:
            self.streams.h2d.synchronize()  # no copy may still read a master the optimizer will write
        self._backward_began = False
        for part in self.resident_parts:
            part.sent_early = False
        if self._recorded:
            self._order = self._call_order(self._recorded)
        self._recorded = []
        self._stashes = []
        self._calls = {}
        self._pos = 0

    def wait_updates(self) -> None:
        """Host sync point: the overlapped optimizer updates of this step have all run."""
        self._updates_done()
        self.on_grads_final = None

    def _updates_done(self) -> None:
        self.grads.wait_updates()  # host wait; raises what an update raised
        self._updates.clear()

    def take_claimed(self) -> set[int]:
        """Ids of the stores whose update was handed to ``on_grads_final`` since the last call: the
        caller's optimizer step must skip them (they are updated, or will be before they are used)."""
        claimed, self._claimed = self._claimed, set()
        return claimed

    def settle(self, wait: bool = True) -> None:
        """Resident parameters back to their host masters (gradients included), gradients drained and,
        with ``wait``, every overlapped update run.

        ``wait=False`` lets the updates run on: each store's next trip to the device waits for its own
        update (a host wait in :meth:`acquire` or :meth:`ensure_resident`), so the next forward starts as
        soon as its first blocks are updated. Nothing else may read or write the host masters, moments or
        ``.grad`` of the stores meanwhile: call ``settle()`` before that.

        A step may go on after it (manual optimisation steps inside ``training_step``): the next module
        that owns a resident parameter pulls them onto the device again.
        """
        self._resident_to_host(with_grads=True)
        self.grads.drain()
        if wait:
            self.wait_updates()
        else:
            self.on_grads_final = None

    def _await_update(self, key: int, block: bool = True) -> bool:
        """Whether the overlapped update of ``key`` (a block, or RESIDENT) has run; with ``block``, a host
        wait until it has. Buffer lifetime: its masters may be copied to the device only after this."""
        fut = self._updates.get(key)
        if fut is None:
            return True
        if not block and not fut.done():
            return False
        t0 = time.perf_counter()
        fut.result()  # host wait (the host optimizer is the bottleneck here); raises what it raised
        self.update_wait_s += time.perf_counter() - t0
        del self._updates[key]
        return True

    def weights_changed(self) -> None:
        """The host masters were updated (optimizer step, checkpoint load): device copies are stale."""
        self.slots.invalidate()
        for part in self.resident_parts:
            part.stale = True

    # ------------------------------------------------------------------ resident parameters
    def _resident_owners(self) -> list[nn.Module]:
        part_of = {id(p): part for part in self.resident_parts for p in part.store.params}
        block_ids = {id(b) for b in self.blocks}
        owners: list[nn.Module] = []
        stack: list[nn.Module] = [self.root]
        seen: set[int] = set()
        while stack:
            m = stack.pop()
            if id(m) in seen or id(m) in block_ids:
                continue
            seen.add(id(m))
            parts = {id(part_of[id(p)]): part_of[id(p)] for p in m._parameters.values() if p is not None and id(p) in part_of}
            if parts:
                owners.append(m)
                self._owned_parts[id(m)] = list(parts.values())
            stack.extend(c for c in m._modules.values() if c is not None)
        return owners

    def _resident_pre_hook(self, module: nn.Module, args: Any) -> None:
        if not self.in_step:
            return
        if module is self._split_owner and torch.is_grad_enabled():
            assert self._split is not None
            self._split.looked_up(args[0] if args and isinstance(args[0], torch.Tensor) else None)
        for part in self._owned_parts[id(module)]:
            if part is self._after and torch.is_grad_enabled() and not self._calls.get(len(self.blocks) - 1):
                self._after_early = False  # used before the last block: its gradients are final only at the end
            self._ensure_part(part)

    def ensure_resident(self) -> None:
        """Point every resident parameter at its device copy (refreshed first if the masters changed)."""
        for part in self.resident_parts:
            self._ensure_part(part)

    def _ensure_part(self, part: ResidentPart, wait: bool = True) -> None:
        """One part onto the device; without ``wait``, only if its update (if one runs on) has run."""
        if part.on_device:
            return
        store = part.store
        if part.stale:
            fut = self._updates.get(part.key)
            ranged = self._ranged.pop(part.key, None)
            if fut is None:
                ranged = None  # its update was waited for already: one copy
            if ranged is None:
                if not self._await_update(part.key, block=wait):
                    return  # its owner's forward hook brings it later
            elif not wait and not fut.done():
                self._ranged[part.key] = ranged
                return
            if part.device is None:
                part.device = torch.empty(store.numel, device=self.device)
                part.views = store.layout.views(part.device)
            compute = self.streams.compute()
            with self.streams.on(self.streams.h2d):
                if self.streams.cuda:
                    self.streams.h2d.wait_stream(compute)  # no queued kernel may still read the old copy
                if ranged is not None:
                    t0 = time.perf_counter()
                    for j, (a, b) in enumerate(ranged.ranges()):
                        ranged.done[j].wait()  # host wait: range j is updated (the rest may still be running)
                        part.device[a:b].copy_(store.master[a:b], non_blocking=True)
                    self.update_wait_s += time.perf_counter() - t0
                    self._await_update(part.key)  # done by now; raises what the update raised
                    self.ranged_copies += len(ranged.done)
                elif store.master.dtype == part.device.dtype:
                    part.device.copy_(store.master, non_blocking=True)
                else:  # bf16 masters (host_state="compact"): copy as they are, widen on the device
                    stage = torch.empty(store.numel, dtype=store.master.dtype, device=self.device)
                    stage.copy_(store.master, non_blocking=True)
                    part.device.copy_(stage)
                    # Buffer lifetime: allocated on the h2d stream, read only there; freed after the cast.
                ev = self.streams.event()
                ev.record(self.streams.h2d)
            self.streams.wait(compute, ev)
            self.counters.bump(self.counters.h2d, part.key)
            part.stale = False
        part.saved_grads = []
        for p, dv in zip(store.params, part.views):
            part.saved_grads.append(p.grad)
            p.grad = None  # device gradients accumulate from zero; the host keeps what was there
            p.data = dv
        part.on_device = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's ``zero_grad`` is about to run. An update still running on from the last step
        reads the gradients it would clear: wait for those first (normally done: the forward awaited them).
        Mid-step (Lightning zeroes after the forward of a window's first micro-batch) the resident
        parameters' host gradients are parked, out of its reach: clear them here as it would have."""
        if self._updates:
            self._updates_done()
        for part in self.resident_parts:
            if not part.on_device:
                continue
            if set_to_none:
                part.saved_grads = [None] * len(part.saved_grads)
            else:
                for g in part.saved_grads:
                    if g is not None:
                        g.zero_()

    def _resident_to_host(self, with_grads: bool) -> None:
        for part in self.resident_parts:
            self._part_to_host(part, with_grads)

    def _part_to_host(self, part: ResidentPart, with_grads: bool) -> None:
        if not part.on_device:
            return
        store = part.store
        grads = [p.grad for p in store.params]
        for p, host_view, saved in zip(store.params, store.master_views, part.saved_grads):
            p.grad = None
            p.data = host_view
            p.grad = saved
        part.on_device = False
        if with_grads and part.key == RESIDENT and self._split_active:
            self._split_active = False
            assert self._split is not None and self.on_grads_final is not None
            if grads[0] is None:
                raise RuntimeError(
                    "split_embedding_update: the input embedding got no gradient in a step whose rows were "
                    "updated already (the loss does not depend on its output). Pass "
                    "MegaTrainStrategy(split_embedding_update=False)."
                )
            fut = self._split.end(grads[0], self.on_grads_final, part.priority)
            self._updates[part.key] = fut
            self._claimed.add(id(store))
            self.grads._track(fut)
            self.counters.bump(self.counters.d2h, part.key)
        elif with_grads and any(g is not None for g in grads):
            # The part the next forward needs first: updated and copied back range by range
            ranged = RangedUpdate(store.numel, RANGE_ELEMS) if part.key == RESIDENT and self.on_grads_final else None
            self._send(part.key, store, grads, self.on_grads_final, part.priority, ranged)
            self.counters.bump(self.counters.d2h, part.key)

    def backward_starts(self, block: int) -> None:
        """A block's backward begins. At the first one of a micro-batch whose update overlaps it, the after
        part's gradients are final (the loss's backward, which alone reaches them, is done): send them home
        now, so that their update runs beside the blocks' backward instead of after it."""
        first, self._backward_began = not self._backward_began, True
        before = self.resident_parts[0] if self._split is not None else None
        if first and before is not None and self.on_grads_final is not None and before.on_device and not any(
            g is not None for g in before.saved_grads  # nothing accumulated on the host to add in
        ):
            # the lookups are done: every row's zero-gradient update can start (sparse_rows.py)
            assert self._split is not None
            self._split_active = self._split.begin(self.on_grads_final, before.priority)
        part = self._after
        if not first or part is None or not part.on_device or self.on_grads_final is None or not self._after_early:
            return
        # one pass through the blocks, this one last: every use of the after part came after it
        if block != max(self._calls, default=-1) or any(n != 1 for n in self._calls.values()):
            return
        self._part_to_host(part, with_grads=True)
        part.sent_early = True

    def _after_grad_landed(self, param: torch.Tensor) -> None:
        if self._after is not None and self._after.sent_early:
            raise RuntimeError(
                "a gradient reached a parameter used only after the last block once its gradients had been "
                "sent to the host (at the first block's backward): this model's backward does not follow its "
                "forward order. Pass MegaTrainStrategy(overlap_optimizer=False) (StreamingEngine: leave "
                "on_grads_final unset) and report the model."
            )

    # ------------------------------------------------------------------ blocks
    def _make_forward(self, index: int, block: nn.Module) -> Callable[..., Any]:
        original = type(block).forward
        self._original_forwards[index] = original
        engine = self

        def streamed_forward(*args: Any, **kwargs: Any) -> Any:
            if not engine.in_step:
                return original(block, *args, **kwargs)  # outside a step: a plain host module
            _no_kv_cache(kwargs)
            if not torch.is_grad_enabled():
                weights = engine.acquire(index)
                try:
                    return engine.run_forward(index, args, kwargs, weights=weights)
                finally:
                    engine.release(index)
            engine._recorded.append(index)  # the call order predicts the next micro-batch's prefetches
            engine._calls[index] = engine._calls.get(index, 0) + 1
            spec = CallSpec(args, kwargs)
            anchor = engine._anchor()
            outs = StreamedBlock.apply(engine, index, spec, anchor, *spec.take_tensors())
            return spec.rebuild_output(outs)

        return streamed_forward

    def _anchor(self) -> torch.Tensor:
        if self._anchor_t is None:
            self._anchor_t = torch.zeros((), device=self.device, requires_grad=True)
        return self._anchor_t

    def requires_grad_flags(self, block: int) -> Sequence[bool]:
        return self._flags[block]

    def keeps(self, block: int) -> bool:
        """Whether ``block`` keeps its activations (no recompute) during a step."""
        return block in self.keep

    def saves_matmuls_only(self, block: int) -> bool:
        """Whether kept ``block`` saves only matmul and attention outputs (``kept_saves="matmuls"``)."""
        return self.kept_saves == "matmuls"

    def _call_order(self, forward: list[int]) -> list[int]:
        """Weight acquisitions of one micro-batch: the forward calls, then the recomputes in reverse."""
        return forward + [b for b in reversed(forward) if b not in self.keep]

    # ------------------------------------------------------------------ saved inputs in host memory
    def stash(self, tensors: Sequence[torch.Tensor]) -> "_Stash":
        """Saved inputs of a recomputed block; with ``offload_inputs`` the large ones go to the host.

        Offloaded: floating tensors that require grad (the residual stream; position tables and masks
        are shared by every block and stay). Buffer lifetime: the device tensor is recorded on the
        device→host stream, so the caching allocator reuses its memory only after the copy has run.
        """
        stash = _Stash(list(tensors))
        if not (self.offload_inputs and self.in_step):
            return stash
        compute, d2h = self.streams.compute(), self.streams.d2h
        produced = self.streams.event()
        produced.record(compute)
        for i, t in enumerate(tensors):
            if not (t.is_floating_point() and t.requires_grad and t.device == self.device):
                continue
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pins.enabled)
            with self.streams.on(d2h):
                self.streams.wait(d2h, produced)
                host.copy_(t.detach(), non_blocking=True)
                if self.streams.cuda:
                    t.record_stream(d2h)
            stash.host[i] = host
            stash.tensors[i] = None
        if stash.host:
            stash.offloaded = self.streams.event()
            stash.offloaded.record(d2h)
            stash.index = len(self._stashes)
            self._stashes.append(stash)
        return stash

    def unstash(self, stash: "_Stash") -> list[torch.Tensor]:
        """The saved inputs back on the device (a device-side wait); the next stash back starts now."""
        self._fetch(stash)
        if stash.index > 0:
            self._fetch(self._stashes[stash.index - 1])  # backward runs in reverse: prefetch one ahead
        if stash.fetched is not None:
            self.streams.wait(self.streams.compute(), stash.fetched)
            if self.streams.cuda:
                for t in stash.device.values():
                    t.record_stream(self.streams.compute())
        out = [stash.device.get(i, t) for i, t in enumerate(stash.tensors)]
        stash.release()
        return out  # type: ignore[return-value]

    def _fetch(self, stash: "_Stash") -> None:
        if not stash.host or stash.fetched is not None or stash.released:
            return
        h2d = self.streams.h2d
        with self.streams.on(h2d):
            self.streams.wait(h2d, stash.offloaded)
            for i, host in stash.host.items():
                # only tensors that required grad were offloaded: the recompute differentiates them
                stash.device[i] = host.to(self.device, non_blocking=True).requires_grad_()
            stash.fetched = self.streams.event()
            stash.fetched.record(h2d)

    def run_forward(self, block: int, args: tuple, kwargs: dict, weights: Sequence[torch.Tensor] | None = None) -> Any:
        if weights is None:
            weights = self.acquire(block)
            release = True
        else:
            release = False
        try:
            with self.bindings[block].bound(weights):
                return self._original_forwards[block](self.blocks[block], *args, **kwargs)
        finally:
            if release:
                self.release(block)

    def acquire(self, block: int) -> list[torch.Tensor]:
        """Weights of ``block`` in a device slot, ready for the compute stream (a device-side wait)."""
        try:
            self._pos = self._order.index(block, self._pos) + 1
        except ValueError:
            pass
        s = self.slots.slot_of(block)
        if s is None:
            s = self._load(block, protect={block})
            assert s is not None
        elif self._slot_used[s]:
            self.counters.bump(self.counters.reused, block)
        self._slot_used[s] = True
        self.streams.wait(self.streams.compute(), self._ready[s])
        self._prefetch(current=block)
        key = (block, s)
        if key not in self._views:
            self._views[key] = self.stores[block].layout.views(self.slots.buffers[s])
        return self._views[key]

    def release(self, block: int) -> None:
        s = self.slots.slot_of(block)
        if s is not None:
            self._free[s].record(self.streams.compute())

    def _prefetch(self, current: int | None) -> None:
        window = []
        for b in self._order[self._pos : self._pos + self.slots.depth - (0 if current is None else 1)]:
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
        """Copy ``block``'s weights into a slot, once its update (if one is running on) has run; without
        ``wait``, None instead of waiting for that."""
        if not self._await_update(block, block=wait):
            return None
        s = self.slots.fixed.get(block)
        if s is None:
            s = self._free_slot(protect)
        if s is None:
            raise RuntimeError("no free device slot: raise `slots`")
        store = self.stores[block]
        n = store.numel
        h2d = self.streams.h2d
        with self.streams.on(h2d):
            # Slot lifetime: the copy must not overwrite weights a queued kernel still reads.
            self.streams.wait(h2d, self._free[s])
            if self.slots.staging is not None:
                stage = self.slots.staging[:n]
                stage.copy_(store.master, non_blocking=True)
                self.slots.buffers[s][:n].copy_(stage)  # fp32 -> compute dtype on the device
            else:
                self.slots.buffers[s][:n].copy_(store.master, non_blocking=True)
            self._ready[s].record(h2d)
        self.slots.block_in_slot[s] = block
        self._slot_used[s] = False
        self.counters.bump(self.counters.h2d, block)
        return s

    def offload_grads(self, block: int, grads: Sequence[torch.Tensor | None]) -> None:
        left = self._calls.get(block, 1) - 1
        self._calls[block] = left
        final = left <= 0  # a block called twice in the forward is final after its second backward
        self._send(block, self.stores[block], grads, self.on_grads_final if final else None)
        self.counters.bump(self.counters.d2h, block)

    def _send(self, key: int, store: FlatStore, grads: Sequence[torch.Tensor | None],
              then: Callable[[FlatStore], None] | None, priority: int | None = None,
              ranged: RangedUpdate | None = None) -> None:
        # The worker runs jobs in the next forward's order: blocks by index, the resident parts around them.
        fut = self.grads.send(store, grads, then, priority=key if priority is None else priority, ranged=ranged)
        if fut is not None:
            self._updates[key] = fut
            self._claimed.add(id(store))
            if ranged is not None and not ranged.whole:
                self._ranged[key] = ranged

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Restore the blocks' own ``forward``, drop device memory and unpin the host buffers.

        The parameters stay views of the (now pageable) host buffers: the trained values.
        """
        self.settle()
        self.grads.close()
        for block in self.blocks:
            if "forward" in block.__dict__:
                del block.forward
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.streams.cuda:
            torch.cuda.synchronize(self.device)
        # Device memory goes now, not when the last reference to the engine does.
        self.slots.buffers, self.slots.staging = [], None
        self.grads.slabs = []
        self._views = {}
        for part in self.resident_parts:
            part.device, part.views = None, []
        self.pins.close()

    def reset_counters(self) -> None:
        self.counters = CopyCounters()

    def all_stores(self) -> list[FlatStore]:
        return self.stores + [part.store for part in self.resident_parts]


class _Stash:
    """The saved inputs of one recomputed block call: device tensors, or host copies while offloaded."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors: list[torch.Tensor | None] = list(tensors)
        self.host: dict[int, torch.Tensor] = {}
        self.device: dict[int, torch.Tensor] = {}
        self.offloaded: Any = None
        self.fetched: Any = None
        self.index = 0
        self.released = False

    def release(self) -> None:
        self.host, self.device, self.released = {}, {}, True


def _accumulators_fit(stores: Sequence[FlatStore]) -> bool:
    """Whether every store's own fp32 gradient accumulator and its Adam moments (allocated on first use)
    fit in the host memory available now, leaving a tenth of the total free. False where unknown."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        available, total = info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        return False
    need = 0
    for s in stores:
        need += 4 * s.numel if s.grad is None else 0
        need += 2 * s.numel * s.dtype.itemsize if s.exp_avg is None else 0
    return need <= available - total // 10


def _no_kv_cache(kwargs: dict) -> None:
    """Hugging Face decoder layers: a recomputed layer must not append to a KV cache a second time."""
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    for key in ("past_key_values", "past_key_value", "cache", "layer_past"):
        if key in kwargs:
            kwargs[key] = None
