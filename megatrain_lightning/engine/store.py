"""Flat host buffers that own every byte of a block's training state.

One :class:`FlatStore` per streamed block (and one for the resident parts: embeddings, norms, head).
It lays the block's parameters out in one contiguous fp32 buffer, at offsets aligned to 64 bytes, and
turns the module's own parameters into views of it: ``state_dict()``, checkpoints and callbacks keep
seeing ordinary host tensors that *are* the master weights. The gradient accumulator and the Adam
moments use the same layout, so that one copy moves a whole block in either direction.

Memory (``host_state="fp32"``, the default): 4 bytes/param master, 4 gradient (allocated on first use),
8 Adam moments (allocated by the host optimizer): 12 B/param of lasting state.

``host_state="compact"``: 8 B/param of lasting state, for models whose fp32 state does not fit. The fp32
master is kept *exactly*, split in two 16-bit halves: ``master`` holds its high half rounded to nearest
(a bf16 tensor: the parameters are bf16 views, and a block goes to the device as these bytes, half the
host→device traffic) and ``master_low`` (int16) the low half, so that ``join_fp32(master, master_low)``
gives back the fp32 bits and every update is applied to the fp32 weight (no small AdamW update rounds
away, unlike plain bf16 masters). Adam's moments are bf16 (2+2 B). The gradient accumulator stays fp32
(4 B, transient). The parameters' ``grad_dtype`` is fp32 so the accumulators can be their ``.grad``.

Frozen parameters (those that do not require grad and no optimizer holds: a LoRA base, a frozen head)
come last in the layout and live in a buffer of their own dtype (``frozen``): no fp32 master, gradient or
moment for them, so a bf16 base keeps 2 B/param on the host and travels as it is. Gradients, moments and
the gradient path cover the trainable region ``[0, train_numel)`` only. A store is laid out again
(:meth:`FlatStore.relayout`) when a frozen parameter starts to train.

Host buffers come from ``host_buffers.py`` (pinned at their exact size; the node's shared copy under data
parallel).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..config import HOST_STATES, HostState
from .host_buffers import PinnedRegistry
from .layout import FlatLayout, align, region_split, trainable_first


def join_fp32(hi: torch.Tensor, lo: torch.Tensor, bits: torch.Tensor, tmp: torch.Tensor) -> None:
    """fp32 bit patterns (``bits``, int32) from a bf16 high half ``hi`` and an int16 low half ``lo``.

    ``hi`` is the high half rounded half-up (see :func:`split_fp32`), so the exact bits are
    ``(hi << 16) + lo`` with ``lo`` sign-extended: a negative ``lo`` is exactly the round-up to undo.
    ``tmp``: int32 scratch of the same length (a same-dtype add is ~2x faster than a mixed one).
    """
    bits.view(torch.float32).copy_(hi)  # bf16 -> fp32 is exact: the bits become hi << 16
    tmp.copy_(lo)  # sign-extends
    bits.add_(tmp)


def split_fp32(bits: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, tmp: torch.Tensor) -> None:
    """Inverse of :func:`join_fp32`: ``hi`` = the fp32 value rounded to the nearest bf16 (ties away from
    zero: the only difference from ``.bfloat16()``), ``lo`` = the low 16 bits of ``bits``."""
    lo.copy_(bits)  # int32 -> int16 keeps the low 16 bits
    torch.add(bits, 0x8000, out=tmp)
    tmp.bitwise_right_shift_(16)  # arithmetic shift: the rounded high half, in int16 range
    hi.view(torch.int16).copy_(tmp)


_FROZEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def frozen_dtype(params: Sequence[nn.Parameter]) -> torch.dtype:
    """The host dtype of a store's frozen region: the parameters' own when they share one, else fp32."""
    dtypes = {p.dtype for p in params}
    return dtypes.pop() if len(dtypes) == 1 and next(iter(dtypes)) in _FROZEN_DTYPES else torch.float32


class FlatStore:
    """Master weights (and, lazily, gradients and Adam moments) of one block, as flat host buffers.

    Construction copies each parameter's current value into its buffer and re-points the parameter at
    its view (``param.data = view``), so the module keeps its own Parameter objects. Trainable parameters
    held in bf16 or fp16 are upcast into the fp32 masters (listed in ``upcast``, for the caller's log).

    Args:
        params: the block's parameters, in their order.
        pins: where pinned buffers come from (masters, frozen weights and gradients: what is copied).
        host_state: ``"fp32"`` (fp32 master and moments, 12 B/param + 4 B gradient) or ``"compact"``
            (the fp32 master as bf16 high half + int16 low half, bf16 moments: 8 B/param + 4 B
            gradient; the parameters become bf16 views). See the module docstring.
        compensate: compact only. False drops the low half: plain bf16 masters (6 B/param), on which
            updates smaller than half a bf16 step round away. For measuring that failure, not for use.
        trainable: ids of the parameters in the trainable region; None: those that require grad.
        master, frozen: the two buffers, already allocated and laid out as this store will lay them out
            (the engine materialises meta-built parameters as their views); parameters that already are
            their view are not copied.
        name: under data parallel, the store's name in the node's shared arena: its masters, frozen
            weights, low halves, moments, step counts and publication counter are the node's one copy.
        write: copy the parameters' values in (False on a node's other ranks: the first one does).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        pins: PinnedRegistry,
        host_state: HostState = "fp32",
        compensate: bool = True,
        trainable: set[int] | None = None,
        master: torch.Tensor | None = None,
        frozen: torch.Tensor | None = None,
        name: str | None = None,
        write: bool = True,
    ) -> None:
        if host_state not in HOST_STATES:
            raise ValueError(f"host_state={host_state!r}: expected one of {HOST_STATES}")
        self.layout, self.n_trainable = trainable_first(params, trainable)
        self._pins = pins
        self.host_state = host_state
        self.compensate = compensate
        self.compact = host_state == "compact"
        if self.compact and not hasattr(torch.Tensor, "grad_dtype"):
            raise RuntimeError(
                f"host_state='compact' needs torch >= 2.10 (Tensor.grad_dtype: bf16 parameters with fp32 "
                f"gradients); this is torch {torch.__version__}. Use host_state='fp32'."
            )
        self.dtype = torch.bfloat16 if self.compact else torch.float32
        n = self.train_numel = region_split(self.layout, self.n_trainable)
        frozen_params = self.layout.params[self.n_trainable :]
        self.frozen_dtype = frozen_dtype(frozen_params)
        self.name = name
        shared = pins.arena is not None and name is not None
        if master is None:
            master = pins.shared(name and f"{name}.master", n, self.dtype, pin=True)
            if not shared:
                master.zero_()  # alignment padding stays zero: it enters norms and copies
        if frozen is None:
            frozen = pins.shared(name and f"{name}.frozen", self.layout.numel - n, self.frozen_dtype, pin=True)
            if not shared:
                frozen.zero_()
        if master.numel() != n or master.dtype != self.dtype or frozen.numel() != self.layout.numel - n:
            raise ValueError(f"buffers of {master.numel()} {master.dtype} + {frozen.numel()} do not fit this layout")
        self.master, self.frozen = master, frozen
        # compact: the low 16 bits of each fp32 master (pageable: never copied to the device)
        self.master_low: torch.Tensor | None = (
            pins.shared(name and f"{name}.low", n, torch.int16, pin=False) if self.compact and compensate else None)
        self.grad: torch.Tensor | None = None
        self.grad_views: list[torch.Tensor] = []  # the trainable parameters' views of ``grad``
        self.grad_lent = False  # grad is a pooled buffer (see grads.py), not the store's own
        # bf16 gradients on their way into an update (see :meth:`hold_half_grad`), and the store's own
        # pinned buffer for them (allocated on first need, when no pooled buffer is lent)
        self.half_grad: torch.Tensor | None = None
        self.half_wide: torch.Tensor | None = None  # fp32 gradients of the one-dimensional weights beside it
        self._own_half_grad: torch.Tensor | None = None
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        # Data parallel: the node's copies are mapped now by every rank; step counts live beside the moments
        # (so that any rank's optimizer state is the owner's), and the owner raises ``published`` each step.
        self.step_counts: torch.Tensor | None = None
        self.published: torch.Tensor | None = None
        if shared:
            self.moment_buffers()
            self.step_counts = pins.shared(f"{name}.steps", max(self.n_trainable, 1), torch.float32, pin=False)
            self.published = pins.shared(f"{name}.published", 1, torch.int64, pin=False)
        self.upcast: list[nn.Parameter] = []  # trainable parameters given in bf16/fp16, now fp32
        self.upcast_from: list[torch.Tensor] = []  # their original tensors' dtypes, for the log line
        self.master_views = self.train_views(master) + self.frozen_views(frozen)
        low_views = self.train_views(self.master_low) if self.master_low is not None else None
        with torch.no_grad():
            for k, (p, view) in enumerate(zip(self.layout.params, self.master_views)):
                if k >= self.n_trainable or not self.compact:
                    if p.is_floating_point() and p.dtype != view.dtype:
                        if p.dtype not in _FROZEN_DTYPES:
                            raise TypeError(f"parameter of dtype {p.dtype}: the host store takes fp32, bf16 or fp16")
                        if k < self.n_trainable:
                            self.upcast.append(p)
                            self.upcast_from.append(torch.empty(0, dtype=p.dtype))
                    if write and p.data_ptr() != view.data_ptr():  # materialised in place already: nothing to copy
                        view.copy_(p.detach())
                else:
                    if p.is_floating_point() and p.dtype not in (torch.float32, torch.bfloat16):
                        raise TypeError(f"parameter of dtype {p.dtype}: host_state='compact' takes fp32 or bf16")
                    if write:
                        value = p.detach().reshape(-1).to(torch.float32)
                        m = value.numel()
                        low = low_views[k].view(-1) if low_views is not None else torch.empty(m, dtype=torch.int16)
                        split_fp32(value.view(torch.int32), view.view(-1), low, torch.empty(m, dtype=torch.int32))
                p.data = view
                if self.compact and k < self.n_trainable:
                    p.grad_dtype = torch.float32  # the fp32 accumulators become bf16 parameters' .grad

    @property
    def params(self) -> list[nn.Parameter]:
        return self.layout.params

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def trainable(self) -> list[nn.Parameter]:
        return self.layout.params[: self.n_trainable]

    def train_views(self, flat: torch.Tensor | None) -> list[torch.Tensor]:
        """Views shaped like each trainable parameter of a flat buffer of the trainable region."""
        if flat is None:
            return []
        return [flat[o : o + p.numel()].view(p.shape) for o, p in zip(self.layout.offsets, self.trainable)]

    def frozen_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views shaped like each frozen parameter of the frozen region's buffer."""
        n = self.train_numel
        frozen = self.layout.params[self.n_trainable :]
        return [flat[o - n : o - n + p.numel()].view(p.shape) for o, p in zip(self.layout.offsets[self.n_trainable :], frozen)]

    def regions(self) -> list[tuple[torch.Tensor, int, int]]:
        """(host buffer, start, end) of the non-empty regions in the flat layout: what a copy of the whole
        store to a device buffer of ``numel`` elements consists of."""
        out = [(self.master, 0, self.train_numel), (self.frozen, self.train_numel, self.numel)]
        return [r for r in out if r[2] > r[1]]

    def grad_buffer(self) -> torch.Tensor:
        """The fp32 gradient accumulator (pinned: the device→host copy lands in it directly).

        The store's own buffer, allocated on first use, unless a pooled buffer is lent right now
        (:meth:`lend_grad`).
        """
        if self.grad is None:
            idle = self._own_half_grad if self.half_grad is None else None
            if idle is not None and idle.numel() >= self.train_numel:
                # the accumulator it once was (see hold_half_grad), pinned already: an accumulator again
                self._own_half_grad, self.grad = None, idle[: self.train_numel]
            else:
                self._free_own_half_grad()  # 2 B/param idle since the last overlapped step: not both at once
                self.grad = self._pins.empty(self.train_numel)
            self.grad.zero_()
            self.grad_views = self.train_views(self.grad)
        return self.grad

    def free_own_grad(self) -> None:
        """Let go of the store's own fp32 gradient accumulator while it holds nothing (no parameter's
        ``.grad`` is a view of it): the gradients go as bf16 from now on (:meth:`hold_half_grad`), and a
        7B model would otherwise keep both, 4 + 2 B/param of host memory (the step that tries a placement
        does not overlap its updates, so it fills fp32 accumulators; the steps after it send bf16)."""
        if self._grad_idle():
            self._pins.release([self.grad])
            self.grad, self.grad_views = None, []

    def _grad_idle(self) -> bool:
        """Whether the store's own fp32 accumulator exists and holds nothing (no ``.grad`` is a view of it)."""
        return self.grad is not None and not self.grad_lent and all(p.grad is None for p in self.trainable)

    def _free_own_half_grad(self) -> None:
        if self._own_half_grad is not None and self.half_grad is None:
            self._pins.release([self._own_half_grad])
            self._own_half_grad = None

    def lend_grad(self, buffer: torch.Tensor) -> None:
        """Use ``buffer`` (pinned fp32, at least ``train_numel`` long) as the gradient accumulator until
        :meth:`return_grad`: one step's gradients, when nothing accumulates, need no buffer of their own."""
        assert self.grad is None, "the store already has a gradient buffer"
        self.grad = buffer[: self.train_numel]
        self.grad_views = self.train_views(self.grad)
        self.grad_lent = True

    def return_grad(self) -> None:
        """Give the lent buffer back: parameters whose ``.grad`` is a view of it lose it (set to None)."""
        for p, view in zip(self.trainable, self.grad_views):
            if p.grad is view:
                p.grad = None
        self.grad, self.grad_views, self.grad_lent = None, [], False

    def hold_half_grad(self, lent: torch.Tensor | None = None) -> torch.Tensor:
        """A pinned bf16 buffer for one step's bf16 gradients, read by the next update and then let go
        (:meth:`drop_half_grad`): a view of ``lent`` (a pooled fp32 buffer, reinterpreted) or the store's
        own. Parameters get no ``.grad``: nothing but that update reads these gradients.

        Why bf16: a block computed in bf16 has bf16 gradients; they widen to fp32 without loss, so they
        can travel and wait in host memory at half the bytes and be widened inside the update instead
        (``optim/adam.py``): half the pinned gradient memory and device→host bytes.

        The fp32 gradients of the one-dimensional weights (``FlatLayout.wide``: their device copies are
        fp32, engine/slots.py) travel beside them, in the same buffer past the bf16 region
        (:meth:`half_wide_offset`), as ``half_wide``; the update reads them there. Returns the fp32 buffer
        that holds both, what one device->host copy fills.
        """
        assert self.half_grad is None, "the store holds bf16 gradients not yet used"
        n, h, w = self.train_numel, self.half_wide_offset(), self.layout.wide_numel
        if lent is not None:
            buf = lent[: h + w]
        else:
            # An fp32 accumulator idle since a step without overlap becomes this buffer: none to free, allocate
            # and pin (4.5 s at 7B on the H200); it keeps 4 B/param, the peak the tried step reached anyway.
            if self._own_half_grad is None and self._grad_idle():
                self._own_half_grad, self.grad, self.grad_views = self.grad, None, []
            self.free_own_grad()
            if self._own_half_grad is None or self._own_half_grad.numel() < h + w:  # none yet, or before a widen
                self._own_half_grad = self._pins.empty(h + w)
            buf = self._own_half_grad
        self.half_grad = buf.view(torch.bfloat16)[:n]
        self.half_wide = buf[h : h + w]
        return buf[: h + w]

    def half_wide_offset(self) -> int:
        """Where, in fp32 elements of a gradient buffer holding bf16 gradients, the one-dimensional weights'
        fp32 gradients start: past the ``train_numel`` bf16 ones, aligned. A store can hold bf16
        gradients when that region ends within ``train_numel`` (:meth:`can_hold_half`)."""
        return align((self.train_numel + 1) // 2, FlatLayout.ALIGN_ELEMS)

    def can_hold_half(self) -> bool:
        """Whether the bf16 gradients and the fp32 ones of the one-dimensional weights fit in
        ``train_numel`` fp32 elements (a lent buffer's, a gradient slab's size)."""
        return self.half_wide_offset() + self.layout.wide_numel <= self.train_numel

    def wide_train_views(self, flat: torch.Tensor) -> dict[int, torch.Tensor]:
        """Layout index -> view of ``flat`` (packed fp32, ``wide_numel`` long) of each trainable
        one-dimensional weight."""
        return {i: flat[w : w + self.layout.params[i].numel()].view(self.layout.params[i].shape)
                for i, w in zip(self.layout.wide, self.layout.wide_offsets) if i < self.n_trainable}

    def drop_half_grad(self) -> None:
        self.half_grad = None
        self.half_wide = None

    def moment_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Adam's first and second moments, zero-initialised on first use (pageable: never copied).

        fp32, or bf16 with ``host_state="compact"``.
        """
        if self.exp_avg is None:
            name = self.name
            self.exp_avg = self._pins.shared(name and f"{name}.ea", self.train_numel, self.dtype, pin=False)
            self.exp_avg_sq = self._pins.shared(name and f"{name}.eas", self.train_numel, self.dtype, pin=False)
        assert self.exp_avg_sq is not None
        return self.exp_avg, self.exp_avg_sq

    def master_fp32(self) -> torch.Tensor:
        """The trainable region's fp32 master weights as one flat tensor (a copy; the buffer itself in fp32
        mode)."""
        if not self.compact:
            return self.master
        if self.master_low is None:
            return self.master.float()
        n = self.train_numel
        bits = torch.empty(n, dtype=torch.int32)
        join_fp32(self.master, self.master_low, bits, torch.empty(n, dtype=torch.int32))
        return bits.view(torch.float32)

    def lasting_bytes(self) -> int:
        """Host bytes of lasting state: masters (both halves), frozen weights and Adam moments; the gradient
        is transient."""
        tensors = (self.master, self.master_low, self.frozen, self.exp_avg, self.exp_avg_sq)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def buffers(self) -> list[torch.Tensor | None]:
        return [self.master, self.frozen, self.master_low, self.grad if not self.grad_lent else None,
                self._own_half_grad, self.exp_avg, self.exp_avg_sq]

    def shared_buffers(self) -> list[torch.Tensor]:
        """What the node's ranks share (data parallel), for keeping nodes consistent."""
        out = [self.master, self.frozen, self.master_low, self.exp_avg, self.exp_avg_sq, self.step_counts]
        return [t for t in out if t is not None]

    def publish(self) -> None:
        """Data parallel, the owner: this store's update of the step is done (seen by the node's ranks)."""
        if self.published is not None:
            self.published.add_(1)

    def relayout(self, trainable: set[int]) -> FlatStore:
        """A new store of the same parameters with ``trainable`` (ids) in the trainable region, values,
        moments, low halves and held gradients carried over; the parameters become its views. Between
        steps only (no bf16 gradients held, no pooled buffer lent). The caller re-points optimizer state
        (``HostOptimizer.adopt_state``) and lets this store's buffers go (``PinnedRegistry.release``)."""
        assert self.half_grad is None and not self.grad_lent, "a store is laid out again only between steps"
        old_grads = {id(p): p.grad for p in self.trainable if p.grad is not None}
        moments = dict(zip(map(id, self.trainable), zip(self.train_views(self.exp_avg), self.train_views(self.exp_avg_sq))))
        lows = dict(zip(map(id, self.trainable), self.train_views(self.master_low)))
        for p in self.trainable:
            p.grad = None  # before the new store re-points .data: a grad's shape must follow
        new = FlatStore(self.params, self._pins, self.host_state, self.compensate, trainable=trainable,
                        name=self.name and f"{self.name}r", write=True)
        with torch.no_grad():
            if moments and new.n_trainable:
                ea, eas = new.moment_buffers()
                for p, m, v in zip(new.trainable, new.train_views(ea), new.train_views(eas)):
                    if id(p) in moments:
                        m.copy_(moments[id(p)][0])
                        v.copy_(moments[id(p)][1])
            for p, low in zip(new.trainable, new.train_views(new.master_low)):
                if id(p) in lows:
                    low.copy_(lows[id(p)])
            if self.published is not None and new.published is not None:
                new.published.copy_(self.published)
            if self.step_counts is not None and new.step_counts is not None:
                old_steps = dict(zip(map(id, self.trainable), self.step_counts))
                for k, p in enumerate(new.trainable):
                    if id(p) in old_steps:
                        new.step_counts[k].copy_(old_steps[id(p)])
            if old_grads:
                new.grad_buffer()
                for p, view in zip(new.trainable, new.grad_views):
                    g = old_grads.get(id(p))
                    if g is not None:
                        view.copy_(g)
                        p.grad = view
        return new
