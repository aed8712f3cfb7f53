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

Pinning, when asked for, registers the exact buffer with the CUDA driver instead of taking it from
torch's caching pinned allocator, which rounds every request up to a power of two.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..config import HOST_STATES, HostState

ALIGN_BYTES = 64


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


def _align(n: int, elems: int) -> int:
    return (n + elems - 1) // elems * elems


class FlatLayout:
    """Offsets of a list of parameters inside one flat buffer.

    Every parameter starts at a multiple of 16 elements: 64 bytes in fp32, 32 in bf16, so every view
    is aligned for vectorised host kernels and device copies.
    """

    ALIGN_ELEMS = ALIGN_BYTES // 4

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params: list[nn.Parameter] = list(params)
        self.offsets: list[int] = []
        cursor = 0
        for p in self.params:
            self.offsets.append(cursor)
            cursor = _align(cursor + p.numel(), self.ALIGN_ELEMS)
        self.numel = max(cursor, self.ALIGN_ELEMS)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like each parameter, in layout order."""
        return [flat[o : o + p.numel()].view(p.shape) for o, p in zip(self.offsets, self.params)]


class PinnedRegistry:
    """Pins existing host tensors at their exact size (``cudaHostRegister``) and unpins them on close."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and torch.cuda.is_available()
        self._registered: list[torch.Tensor] = []

    def empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        if self.enabled:
            err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            if int(err) != 0:  # fall back to the caching allocator: rounded up, but pinned
                return torch.empty(numel, dtype=dtype, pin_memory=True)
            self._registered.append(t)
        return t

    def close(self) -> None:
        for t in self._registered:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        self._registered.clear()


class FlatStore:
    """Master weights (and, lazily, gradients and Adam moments) of one block, as flat host buffers.

    Construction copies each parameter's current value into the master buffer and re-points the
    parameter at its view (``param.data = view``), so the module keeps its own Parameter objects.

    Args:
        params: the block's parameters, in layout order.
        pins: where pinned buffers come from (master and gradient: the buffers that are copied).
        host_state: ``"fp32"`` (fp32 master and moments, 12 B/param + 4 B gradient) or ``"compact"``
            (the fp32 master as bf16 high half + int16 low half, bf16 moments: 8 B/param + 4 B
            gradient; the parameters become bf16 views). See the module docstring.
        compensate: compact only. False drops the low half: plain bf16 masters (6 B/param), on which
            updates smaller than half a bf16 step round away. For measuring that failure, not for use.
        master: the master buffer, already allocated and laid out as ``FlatLayout(params)`` (the engine
            materialises meta-built parameters as its views); parameters that already are their view
            are not copied.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        pins: PinnedRegistry,
        host_state: HostState = "fp32",
        compensate: bool = True,
        master: torch.Tensor | None = None,
    ) -> None:
        if host_state not in HOST_STATES:
            raise ValueError(f"host_state={host_state!r}: expected one of {HOST_STATES}")
        self.layout = FlatLayout(params)
        self._pins = pins
        self.compact = host_state == "compact"
        if self.compact and not hasattr(torch.Tensor, "grad_dtype"):
            raise RuntimeError(
                f"host_state='compact' needs torch >= 2.10 (Tensor.grad_dtype: bf16 parameters with fp32 "
                f"gradients); this is torch {torch.__version__}. Use host_state='fp32'."
            )
        self.dtype = torch.bfloat16 if self.compact else torch.float32
        if master is None:
            master = pins.empty(self.layout.numel, self.dtype)
            master.zero_()  # alignment padding stays zero: it enters norms and copies
        elif master.numel() != self.layout.numel or master.dtype != self.dtype:
            raise ValueError(f"master of {master.numel()} {master.dtype} does not fit this layout")
        self.master = master
        # compact: the low 16 bits of each fp32 master (pageable: never copied to the device)
        self.master_low: torch.Tensor | None = (
            torch.zeros(self.layout.numel, dtype=torch.int16) if self.compact and compensate else None
        )
        self.grad: torch.Tensor | None = None
        self.grad_views: list[torch.Tensor] = []
        self.grad_lent = False  # grad is a pooled buffer (see grads.py), not the store's own
        # bf16 gradients on their way into an update (see :meth:`hold_half_grad`), and the store's own
        # pinned buffer for them (allocated on first need, when no pooled buffer is lent)
        self.half_grad: torch.Tensor | None = None
        self._own_half_grad: torch.Tensor | None = None
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        low_views = self.layout.views(self.master_low) if self.master_low is not None else None
        with torch.no_grad():
            for k, (p, view) in enumerate(zip(self.layout.params, self.layout.views(self.master))):
                if not self.compact:
                    if p.dtype != torch.float32 and p.is_floating_point():
                        raise TypeError(f"parameter of dtype {p.dtype}: the host store keeps fp32 masters only")
                    if p.data_ptr() != view.data_ptr():  # materialised in place already: nothing to copy
                        view.copy_(p.detach())
                else:
                    if p.is_floating_point() and p.dtype not in (torch.float32, torch.bfloat16):
                        raise TypeError(f"parameter of dtype {p.dtype}: host_state='compact' takes fp32 or bf16")
                    value = p.detach().reshape(-1).to(torch.float32)
                    n = value.numel()
                    low = low_views[k].view(-1) if low_views is not None else torch.empty(n, dtype=torch.int16)
                    split_fp32(value.view(torch.int32), view.view(-1), low, torch.empty(n, dtype=torch.int32))
                p.data = view
                if self.compact:
                    p.grad_dtype = torch.float32  # the fp32 accumulators become bf16 parameters' .grad
        self.master_views = self.layout.views(self.master)

    @property
    def params(self) -> list[nn.Parameter]:
        return self.layout.params

    @property
    def numel(self) -> int:
        return self.layout.numel

    def grad_buffer(self) -> torch.Tensor:
        """The fp32 gradient accumulator (pinned: the device→host copy lands in it directly).

        The store's own buffer, allocated on first use, unless a pooled buffer is lent right now
        (:meth:`lend_grad`).
        """
        if self.grad is None:
            self.grad = self._pins.empty(self.layout.numel)
            self.grad.zero_()
            self.grad_views = self.layout.views(self.grad)
        return self.grad

    def lend_grad(self, buffer: torch.Tensor) -> None:
        """Use ``buffer`` (pinned fp32, at least ``numel`` long) as the gradient accumulator until
        :meth:`return_grad`: one step's gradients, when nothing accumulates, need no buffer of their own."""
        assert self.grad is None, "the store already has a gradient buffer"
        self.grad = buffer[: self.layout.numel]
        self.grad_views = self.layout.views(self.grad)
        self.grad_lent = True

    def return_grad(self) -> None:
        """Give the lent buffer back: parameters whose ``.grad`` is a view of it lose it (set to None)."""
        for p, view in zip(self.layout.params, self.grad_views):
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
        """
        assert self.half_grad is None, "the store holds bf16 gradients not yet used"
        n = self.layout.numel
        if lent is not None:
            buf = lent.view(torch.bfloat16)[:n]
        else:
            if self._own_half_grad is None:
                self._own_half_grad = self._pins.empty(n, torch.bfloat16)
            buf = self._own_half_grad
        self.half_grad = buf
        return buf

    def drop_half_grad(self) -> None:
        self.half_grad = None

    def moment_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Adam's first and second moments, zero-initialised on first use (pageable: never copied).

        fp32, or bf16 with ``host_state="compact"``.
        """
        if self.exp_avg is None:
            self.exp_avg = torch.zeros(self.layout.numel, dtype=self.dtype)
            self.exp_avg_sq = torch.zeros(self.layout.numel, dtype=self.dtype)
        assert self.exp_avg_sq is not None
        return self.exp_avg, self.exp_avg_sq

    def master_fp32(self) -> torch.Tensor:
        """The fp32 master weights as one new flat tensor (a copy; the buffer itself in fp32 mode)."""
        if not self.compact:
            return self.master
        if self.master_low is None:
            return self.master.float()
        n = self.layout.numel
        bits = torch.empty(n, dtype=torch.int32)
        join_fp32(self.master, self.master_low, bits, torch.empty(n, dtype=torch.int32))
        return bits.view(torch.float32)

    def lasting_bytes(self) -> int:
        """Host bytes of lasting state: master (both halves) and Adam moments; the gradient is transient."""
        tensors = (self.master, self.master_low, self.exp_avg, self.exp_avg_sq)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
