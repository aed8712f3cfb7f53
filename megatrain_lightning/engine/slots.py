"""Device-side weight slots and the binding of a block module to the weights in a slot.

A slot is one flat device buffer in the compute dtype, as large as the largest block. A block's master
weights arrive in one host→device copy (fp32, into a staging buffer that is then cast on the device
when the compute dtype is narrower), and the block runs with its parameters *bound* to views of the
slot: the module object itself runs, so every per-layer attribute it owns (its ``layer_idx``, its
``sliding_window``, attention sinks) is its own, never another layer's. Binding swaps entries of each
submodule's ``_parameters`` dict for the duration of one call and restores the host Parameters after.

In a compute dtype narrower than fp32 each slot also holds the block's weights of one dimension (norm
gains, biases) in fp32, copied from the staged fp32 masters: Lightning's own bf16-mixed keeps those fp32,
and the ops that read them (norms, adds) run outside autocast's casts, so a bf16 copy would round what they
see (a gain near 1 to steps of 2^-7) and their gradients.

Memory: ``depth`` x ``max_block_numel`` x compute-dtype bytes for the rotating slots, each cached block's
own size for its fixed slot, one fp32 staging buffer of ``max_block_numel`` when casting on device, and
per slot the fp32 one-dimensional weights (``wide_numel``: 47 KB for a Qwen2.5-7B layer).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn


class BlockBinding:
    """Where each parameter and buffer of a block lives in its submodules, so they can be swapped fast."""

    def __init__(self, block: nn.Module, params: Sequence[nn.Parameter]) -> None:
        self.block = block
        by_id: dict[int, list[tuple[nn.Module, str]]] = {}
        buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        for mod in block.modules():
            for name, p in mod._parameters.items():
                if p is not None:
                    by_id.setdefault(id(p), []).append((mod, name))
            for name, b in mod._buffers.items():
                if b is not None:
                    buffers.append((mod, name, b))
        self.param_sites = [by_id[id(p)] for p in params]
        self.params = list(params)
        self.buffer_sites = buffers
        self.device_buffers: list[torch.Tensor] = [b for _, _, b in buffers]
        self.device = torch.device("cpu")
        self.host_versions = [b._version for _, _, b in buffers]
        self.written: list[int] = []  # layout indices of the parameters the last bound() call wrote in place

    def same_structure(self, index: int | None = None) -> None:
        """Refuses a block whose parameters were re-registered since setup (``torch.nn.utils.prune`` and
        Lightning's ``ModelPruning`` move ``weight`` to ``weight_orig`` and recompute it in a pre-hook;
        ``parametrize`` moves it under ``parametrizations``): binding would put streamed weights where the
        module no longer reads them."""
        for sites, p in zip(self.param_sites, self.params):
            for mod, name in sites:
                if mod._parameters.get(name) is not p:
                    path = next((n for n, m in self.block.named_modules() if m is mod), "?")
                    raise RuntimeError(
                        f"MegaTrainStrategy cannot go on training block {'' if index is None else f'{index} '}"
                        f"({type(self.block).__name__}): its parameter "
                        f"{path + '.' if path else ''}{name} was re-registered after setup (torch.nn.utils.prune or "
                        "Lightning's ModelPruning, a parametrization added in training), so the weights it streams "
                        "are no longer the ones the module reads. Prune or parametrize before fit (and "
                        "prune.remove() to make pruning permanent), or train with another strategy.")

    def buffers_to(self, device: torch.device) -> None:
        """Keep a device copy of the block's buffers (they are small, and the forward may not change them)
        until the host ones change (:meth:`bound` looks)."""
        self.device = device
        self.device_buffers = [b.to(device) for _, _, b in self.buffer_sites]
        self.host_versions = [b._version for _, _, b in self.buffer_sites]

    def refresh_buffers(self, device: torch.device) -> None:
        """The block's buffers were replaced (upcast, a user's ``block.gain = new``) or changed in place on
        the host: read them again from its modules."""
        self.buffer_sites = [(mod, name, mod._buffers[name]) for mod, name, _ in self.buffer_sites
                             if mod._buffers.get(name) is not None]
        self.buffers_to(device)

    def mutated_buffers(self) -> list[str]:
        """Names of the buffers whose device copy a call changed in place, or that it replaced with another
        tensor (``self.x = new``: peft's VeLoRA and MonteCLoRA; the binding drops the new one), in the last
        ``bound(check=True)``."""
        paths = {id(m): n for n, m in self.block.named_modules()}
        changed = []
        for i, ((mod, name, _), b, v) in enumerate(zip(self.buffer_sites, self.device_buffers, self._versions)):
            if b._version != v or i in self._replaced:
                how = ", replaced" if i in self._replaced else ""
                changed.append(f"{paths.get(id(mod)) or type(mod).__name__}.{name} ({type(mod).__name__}{how})")
        return changed

    @contextmanager
    def bound(self, tensors: Sequence[torch.Tensor], check: bool = False) -> Iterator[None]:
        """Run the block with ``tensors`` (layout order) in place of its parameters. Weights of one
        dimension (norm gains, biases) still narrower than fp32 (a slot without fp32 copies of them: the
        host holds them narrow) are bound as fp32 casts: what ops outside autocast's lists see under
        Lightning's own bf16-mixed, whose weights are fp32 (CPU layer norms refuse a bf16 weight with an
        fp32 input). ``check``: record the buffers' versions, for :meth:`mutated_buffers`. A buffer the user
        replaced or changed since the last call (between steps: a schedule written into it) is copied again."""
        if any(mod._buffers.get(name) is not b or b._version != v
               for (mod, name, b), v in zip(self.buffer_sites, self.host_versions)):
            self.refresh_buffers(self.device)
        bound = []
        for sites, p, t in zip(self.param_sites, self.params, tensors):
            if t.dim() < 2 and t.dtype in (torch.bfloat16, torch.float16) and p.requires_grad:
                t = t.float()  # differentiable: the gradient reaches the slot's leaf (a frozen one keeps its dtype)
            bound.append(t)
            for mod, name in sites:
                mod._parameters[name] = t  # type: ignore[assignment]
        # a parameter written in place by the call (its version moves) or replaced through .data (its memory
        # moves): see written_params
        marks = [(t._version, t.data_ptr()) for t in bound]
        self.written = []
        if check:
            self._versions = [b._version for b in self.device_buffers]
        for (mod, name, _), b in zip(self.buffer_sites, self.device_buffers):
            mod._buffers[name] = b
        try:
            yield
        finally:
            if check:  # a buffer the call replaced (its new tensor is dropped below)
                self._replaced = {i for i, ((mod, name, _), b) in enumerate(zip(self.buffer_sites, self.device_buffers))
                                  if mod._buffers.get(name) is not b}
            moved = any(t._version != v for t, (v, _) in zip(bound, marks))
            replaced = [i for i, (t, (_, ptr)) in enumerate(zip(bound, marks)) if t.data_ptr() != ptr]
            if moved or replaced:
                self.written = sorted(set(self._changed(bound) if moved else []) | set(replaced))
            for sites, p in zip(self.param_sites, self.params):
                for mod, name in sites:
                    mod._parameters[name] = p
            for mod, name, b in self.buffer_sites:
                mod._buffers[name] = b

    def _changed(self, bound: Sequence[torch.Tensor]) -> list[int]:
        """A call wrote into its bound weights (a version moved; views of one slot share a counter): the layout
        indices of those whose values now differ from their host masters', or every index where none does (a
        write that changed nothing this time)."""
        with torch.no_grad():
            changed = [i for i, (t, p) in enumerate(zip(bound, self.params))
                       if not torch.equal(t, p.detach().to(t.device, t.dtype))]
        return changed or list(range(len(bound)))

    def written_params(self) -> list[str]:
        """Names of the parameters the last :meth:`bound` call wrote in place (``nn.Embedding(max_norm=...)``
        renormalises its weight in its forward; a ``clamp_`` under no_grad) or replaced through ``.data``."""
        paths = {id(m): n for n, m in self.block.named_modules()}
        return [f"{paths.get(id(mod)) or type(mod).__name__}.{name}".lstrip(".")
                for i in self.written for mod, name in self.param_sites[i][:1]]


class DeviceSlots:
    """Device weight buffers: ``depth`` rotating slots, plus one fixed slot per cached block.

    Rotating slots are shared by the streamed blocks in turn. A cached block owns its fixed slot for the
    engine's lifetime; the slot is filled once per optimizer step (the first time the block runs after
    :meth:`invalidate`) and read by every later forward, recompute and kept-activation backward.

    When the compute dtype is narrower than fp32 the fp32 masters land in one fp32 ``staging`` buffer
    and are cast on the device. One buffer is enough: every use of it (host→device copy, then the cast
    into a slot) is queued on the one host→device stream, so stream order keeps it from being
    overwritten before the cast has read it.
    """

    def __init__(
        self,
        depth: int,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        fixed: Sequence[tuple[int, int]] = (),
        master_dtype: torch.dtype = torch.float32,
        wide_numel: int = 0,
    ) -> None:
        if depth < 2:
            raise ValueError(f"slots={depth}: at least 2 device slots are needed to overlap copy and compute")
        self.depth = depth
        self.numel = numel
        self.dtype = dtype
        self.device = device
        self.buffers = [torch.empty(numel, dtype=dtype, device=device) for _ in range(depth)]
        # Fixed slots: (block, numel) -> a buffer of exactly that block's size.
        self.fixed: dict[int, int] = {}
        for block, n in fixed:
            self.fixed[block] = len(self.buffers)
            self.buffers.append(torch.empty(n, dtype=dtype, device=device))
        # Buffer lifetime of both: the slot's; refilled with it (prefetch.py).
        narrow = dtype.itemsize < 4 and wide_numel > 0
        self.wide: list[torch.Tensor | None] = [
            torch.empty(wide_numel, dtype=torch.float32, device=device) if narrow else None for _ in self.buffers]
        needs_staging = dtype != master_dtype  # bf16 masters (host_state="compact") under bf16: none
        self.staging = torch.empty(numel, dtype=master_dtype, device=device) if needs_staging else None
        self._other_staging: dict[torch.dtype, torch.Tensor] = {}  # frozen weights of yet another dtype
        self.block_in_slot: list[int | None] = [None] * len(self.buffers)

    def staging_for(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The device buffer a host region of ``dtype`` lands in before its cast into a slot (None: the
        slot's own dtype, no cast). One per dtype: its uses are ordered by the host->device stream."""
        if dtype == self.dtype:
            return None
        if self.staging is not None and self.staging.dtype == dtype:
            return self.staging
        if dtype not in self._other_staging:
            self._other_staging[dtype] = torch.empty(self.numel, dtype=dtype, device=self.device)
        return self._other_staging[dtype]

    def close(self) -> None:
        self.buffers, self.wide, self.staging, self._other_staging = [], [], None, {}

    def invalidate(self) -> None:
        """Forget what each slot holds (after the masters changed)."""
        self.block_in_slot = [None] * len(self.buffers)

    def slot_of(self, block: int) -> int | None:
        """The slot that holds ``block``'s current weights, or None."""
        s = self.fixed.get(block)
        if s is not None:
            return s if self.block_in_slot[s] == block else None
        for s in range(self.depth):
            if self.block_in_slot[s] == block:
                return s
        return None
