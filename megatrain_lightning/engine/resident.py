"""The resident parameters: what runs outside the streamed blocks (embeddings, final norm, LM head).

They stay on the device for a whole step, as fp32 copies of their host masters, in up to two parts, each
with a store of its own:

* **before** (``RESIDENT``): parameters of modules that come before the last block, or are shared with
  one (the input embedding; a tied LM head). The next forward needs them first.
* **after** (``RESIDENT_AFTER``): parameters that only modules after the last block own (the final norm,
  an untied LM head). Their gradients are final once the loss's backward has run, before any block's
  backward begins, so they are sent home then: their host update overlaps the backward instead of
  following it, and the next forward needs them only at its end. For a 7B model with an untied head that
  takes half of the resident part (0.55 B parameters) off the path between one step and the next.

"Before" and "after" follow the module registration order (``named_modules``), which is the forward order
of every model this package knows; a run-time check sends the after part with the rest at the end of the
backward whenever a step does not keep to it. During a step each parameter's ``.data`` is its device
view and its host ``.grad`` is parked in the part (device gradients accumulate from zero); both go back
at the end of the backward, the device gradients shipped home through the gradient path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .. import attached
from .phase import StepState
from .stats import EngineStats
from .store import FlatStore
from .streams import Streams
from .updates import UpdateTracker

RESIDENT = -1  # counter and job key of the part used before the blocks
RESIDENT_AFTER = -2  # counter and job key of the part used only after them

# send(key, store, grads, then, priority): ship a store's device gradients home (the engine's gradient path)
Send = Callable[[int, FlatStore, Sequence[torch.Tensor | None], Any, int], None]


@dataclass
class ResidentPart:
    """One resident store and its device copy during a step.

    Buffer lifetime: ``device`` (and ``frozen``) are allocated on first use and kept until the engine closes
    (or the store is laid out again); they hold the fp32 copy of the masters (and the frozen weights in their
    own dtype) from the step's first use (``stale`` False) until the next optimizer step.
    """

    key: int  # RESIDENT or RESIDENT_AFTER: counters and update futures
    priority: int  # the host worker's order: where the next forward needs it
    store: FlatStore
    device: torch.Tensor | None = None
    frozen: torch.Tensor | None = None  # the frozen weights' device copy where they are narrower than fp32
    views: list[torch.Tensor] = field(default_factory=list)
    on_device: bool = False  # the parameters' ``.data`` are the device views
    stale: bool = True  # the masters changed since the device copy was made
    saved_grads: list[torch.Tensor | None] = field(default_factory=list)  # host ``.grad`` parked during a step
    versions: list[int] = field(default_factory=list)  # the parameters' versions as they went on the device
    sent_early: bool = False  # this backward's gradients went home at its first block
    # Updated on the device (device_update.py): its Adam moments there, fresh while the host's are the
    # same; the event of the last copy of masters and moments home; whether this step's update ran there
    moments: torch.Tensor | None = None
    moments_fresh: bool = False
    landed: Any = None
    updated_on_device: bool = False


def resident_names(root: nn.Module, blocks: Sequence[nn.Module]) -> tuple[list[str], list[str]]:
    """Names of the resident parameters of ``root`` used before the last block, and only after it.

    A parameter is "after" when every module that holds it comes after the last module inside the blocks
    in ``named_modules()`` order; tied parameters held by an earlier module (a tied LM head) are "before".
    """
    block_ids = {id(b) for b in blocks}
    inside: set[int] = set()
    for b in blocks:
        inside.update(id(m) for m in b.modules())
    order: dict[int, int] = {}
    last_block = -1
    for i, (_, m) in enumerate(root.named_modules(remove_duplicate=False)):
        order.setdefault(id(m), i)
        if id(m) in inside or id(m) in block_ids:
            last_block = i
    first_owner: dict[int, int] = {}
    for m in root.modules():
        if id(m) in inside:
            continue
        for p in m._parameters.values():
            if p is not None:
                first_owner[id(p)] = min(first_owner.get(id(p), order[id(m)]), order[id(m)])
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    before, after = [], []
    for name, p in root.named_parameters():
        if id(p) in in_blocks:
            continue
        (after if first_owner[id(p)] > last_block else before).append(name)
    return before, after


class ResidentParts:
    """The resident parts of one model: on the device during a step, their masters on the host."""

    def __init__(self, root: nn.Module, blocks: Sequence[nn.Module], stores: Sequence[FlatStore | None],
                 streams: Streams, stats: EngineStats, updates: UpdateTracker, state: StepState, send: Send) -> None:
        self.streams = streams
        self.stats = stats
        self.updates = updates
        self.state = state
        self.send = send
        self.device_update: Any = None  # a DeviceUpdate (device_update.py) once the engine has a host worker
        self.last_block = len(blocks) - 1
        keys = ((RESIDENT, -1), (RESIDENT_AFTER, len(blocks)))
        self.parts = [ResidentPart(k, prio, s) for (k, prio), s in zip(keys, stores) if s is not None]
        self.before = next((p for p in self.parts if p.key == RESIDENT), None)
        self.after = next((p for p in self.parts if p.key == RESIDENT_AFTER), None)
        # Learned over the run: every step so far used the after part only after the last block. Cleared
        # for good the first time a step does not (a module of it called before the last block, or a
        # gradient reaching it once the blocks' backward had begun: a term on its weights computed before
        # the forward); its gradients are then sent at the end of the backward. The first backward only
        # watches (``after_watched``): what it learns decides the early send from the next one on.
        self.after_follows_blocks = True
        self.after_watched = False
        self._blocks_backward_began = False  # this micro-batch's
        self._names = {id(p): n for n, p in root.named_parameters()}
        # Any module owning a resident parameter pulls its part onto the device when it runs.
        self._owned: dict[int, list[ResidentPart]] = self._owners(root, blocks)
        self._hooks = [m.register_forward_pre_hook(attached.hook(self._pre_hook)) for m in self._owner_modules]
        if self.after is not None:  # a gradient after the early send would be lost: refuse it loudly
            self._hooks += [p.register_post_accumulate_grad_hook(self._after_grad_landed)
                            for p in self.after.store.params if p.requires_grad]

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.store.params]

    def _owners(self, root: nn.Module, blocks: Sequence[nn.Module]) -> dict[int, list[ResidentPart]]:
        part_of = {id(p): part for part in self.parts for p in part.store.params}
        block_ids = {id(b) for b in blocks}
        owned: dict[int, list[ResidentPart]] = {}
        self._owner_modules: list[nn.Module] = []
        stack: list[nn.Module] = [root]
        seen: set[int] = set()
        while stack:
            m = stack.pop()
            if id(m) in seen or id(m) in block_ids:
                continue
            seen.add(id(m))
            parts = {id(part_of[id(p)]): part_of[id(p)] for p in m._parameters.values() if p is not None and id(p) in part_of}
            if parts:
                self._owner_modules.append(m)
                owned[id(m)] = list(parts.values())
            stack.extend(c for c in m._modules.values() if c is not None)
        return owned

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        if not self.state.step_open:
            return
        for part in self._owned[id(module)]:
            if part is self.after and torch.is_grad_enabled() and not self.state.calls.get(self.last_block):
                self.after_follows_blocks = False  # used before the last block: final only at the end
            self.ensure(part)

    # ------------------------------------------------------------------ onto the device
    def open(self) -> None:
        """A step begins: every part onto the device, the after part only if its update has run (else
        when its owner runs), unless the run has shown it used before the blocks (the model may read its
        weights directly then, not through the owner: they must be the updated ones)."""
        for part in self.parts:
            part.updated_on_device = False  # only the optimizer step right after it may keep the copy
            self.ensure(part, wait=part.key != RESIDENT_AFTER or not self.after_follows_blocks)

    def ensure(self, part: ResidentPart, wait: bool = True) -> None:
        """One part onto the device (refreshed first if its masters changed); without ``wait``, only if its
        update (if one runs on) has run."""
        if part.on_device:
            return
        store = part.store
        if part.stale:
            if not self.updates.wait_for(part.key, block=wait):
                return  # its owner's forward hook brings it later
            if part.device is None:
                self._allocate(part)
            compute = self.streams.compute()
            h2d = self.streams.h2d
            self.streams.after_compute(h2d)  # no queued kernel may still read the old copy
            with self.streams.on(h2d):
                if part.landed is not None:
                    self.streams.wait(h2d, part.landed)  # nor the copy home of a device update
                for src, a, b in store.regions():  # trainable masters, then frozen weights
                    if part.frozen is not None and a == store.train_numel:
                        part.frozen.copy_(src, non_blocking=True)  # frozen weights in their own dtype
                    elif src.dtype == part.device.dtype:
                        part.device[a:b].copy_(src, non_blocking=True)
                    else:  # bf16 masters (compact): copy as they are, widen on the device
                        stage = torch.empty(b - a, dtype=src.dtype, device=self.streams.device)
                        stage.copy_(src, non_blocking=True)
                        part.device[a:b].copy_(stage)
                        # Buffer lifetime: allocated on the h2d stream, read only there; freed after the cast.
                ev = self.streams.record_on(h2d)
            self.streams.wait(compute, ev)
            self.stats.bump(self.stats.h2d, part.key)
            part.stale = False
        part.saved_grads = []
        for p, dv in zip(store.params, part.views):
            part.saved_grads.append(p.grad)
            p.grad = None  # device gradients accumulate from zero; the host keeps what was there
            p.data = dv
        part.versions = [p._version for p in store.params]  # a write in place bumps them (see _written)
        part.on_device = True

    def _allocate(self, part: ResidentPart) -> None:
        """The part's device copy: the trainable weights in fp32, the frozen ones in their own dtype (a frozen
        bf16 teacher, a bf16 base under LoRA: their modules compute in it, as under the default strategy)."""
        store, device = part.store, self.streams.device
        if store.numel > store.train_numel and store.frozen.dtype != torch.float32:
            part.device = torch.empty(store.train_numel, device=device)
            part.frozen = torch.empty(store.numel - store.train_numel, dtype=store.frozen.dtype, device=device)
            part.views = store.train_views(part.device) + store.frozen_views(part.frozen)
        else:
            part.device, part.frozen = torch.empty(store.numel, device=device), None
            part.views = store.layout.views(part.device)

    def relaid(self, key: int, store: FlatStore) -> None:
        """The part's store was laid out again (``store``): its device copy is made again, at its next use."""
        for part in self.parts:
            if part.key == key:
                assert not part.on_device
                part.store = store
                part.device, part.frozen, part.views = None, None, []
                part.stale, part.moments_fresh = True, False

    def stale(self) -> None:
        """The masters changed (an optimizer step, a checkpoint load): the device copies are out of date,
        but for the first such call after a part's update on the device (the optimizer step that ran it:
        the device copy is what the host receives)."""
        for part in self.parts:
            if part.updated_on_device:
                part.updated_on_device = False
            else:
                part.stale, part.moments_fresh = True, False

    def zero_grad(self, set_to_none: bool) -> None:
        """Clear the host gradients parked mid-step, as the optimizer's ``zero_grad`` would have."""
        for part in self.parts:
            if not part.on_device:
                continue
            if set_to_none:
                part.saved_grads = [None] * len(part.saved_grads)
            else:
                for g in part.saved_grads:
                    if g is not None:
                        g.zero_()

    # ------------------------------------------------------------------ back to the host
    def to_host(self, then: Any, keep_writes: bool = True) -> None:
        """Every part back to its host masters; its device gradients go home (into ``then``, the update,
        when one overlaps), and what the step wrote into its weights in place too (not after an abort:
        ``keep_writes`` False)."""
        for part in self.parts:
            self._part_to_host(part, then, keep_writes)

    def _written(self, part: ResidentPart) -> list[int]:
        """Layout indices of the part's parameters written on the device this step: in place (``nn.Embedding(
        max_norm=...)`` renormalises rows of its weight in its forward; a ``clamp_`` under no_grad in the training
        step), or replaced through ``.data`` (peft's CPT projects its delta embedding so in every forward; such a
        write bypasses the version counter, and the parameter no longer views the part's device copy)."""
        return [i for i, (p, v, view) in enumerate(zip(part.store.params, part.versions, part.views))
                if p._version != v or p.data_ptr() != view.data_ptr()]

    def _adopt_replaced(self, part: ResidentPart, written: list[int]) -> None:
        """Copy the parameters of ``written`` replaced through ``.data`` into the part's device copy, which the
        update on the device and the copy home read (their shapes checked in :meth:`refuse_untakeable_writes`)."""
        for i in written:
            p, view = part.store.params[i], part.views[i]
            if p.data_ptr() != view.data_ptr():
                with torch.no_grad():
                    view.copy_(p.detach())  # on the compute stream, after the kernels that made the new tensor

    def _can_take_back(self, part: ResidentPart, i: int) -> bool:
        """Whether a write to parameter ``i`` on the device can go into its host copy exactly: one of the same
        dtype (not compact's bf16 halves of an fp32 master), of this process's own (not a node's shared copy)."""
        return part.store.master_views[i].dtype == part.views[i].dtype and part.store.published is None

    def refuse_untakeable_writes(self) -> None:
        """The first block's backward begins, before any update: refuse a write (see :meth:`_written`) that cannot
        go home exactly, naming the parameter."""
        for part in self.parts:
            if not part.on_device:
                continue
            written = self._written(part)
            resized = [(self._names.get(id(part.store.params[i]), "?"), part.store.params[i], part.views[i])
                       for i in written if part.store.params[i].shape != part.views[i].shape]
            if resized:
                name, p, view = resized[0]
                raise RuntimeError(
                    f"MegaTrainStrategy cannot train {name} exactly: this step replaced it through .data with a tensor "
                    f"of shape {tuple(p.shape)}, not its {tuple(view.shape)}. Keep its shape (resize it between fits), "
                    "or train with Lightning's default strategy.")
            bad = [self._names.get(id(part.store.params[i]), "?") for i in written if not self._can_take_back(part, i)]
            if bad:
                raise RuntimeError(
                    f"MegaTrainStrategy cannot train {', '.join(bad)} exactly: this step wrote it in place "
                    "(nn.Embedding(max_norm=...) renormalises rows in its forward; a clamp_ under no_grad), and its "
                    "host copy cannot take the write exactly (host_state='compact' keeps the fp32 master as bf16 "
                    "halves; under data parallel it is the node's shared copy). Use host_state='fp32' on one "
                    "device, or make the write between steps (in on_train_batch_end, on the weights themselves).")

    def _part_to_host(self, part: ResidentPart, then: Any, keep_writes: bool = True) -> None:
        if not part.on_device:
            return
        store = part.store
        written = self._written(part)
        if written and keep_writes:
            self.refuse_untakeable_writes()
            self._adopt_replaced(part, written)
            if part.landed is not None:
                part.landed.synchronize()  # host wait: a device update's copy home no longer writes the masters
            with torch.no_grad():
                for i in written:
                    # Sync point: a blocking copy on the compute stream, after the kernel that wrote it. Rare
                    # (a module that writes its weights in place): the default strategy's weights have the write too.
                    store.master_views[i].copy_(store.params[i].detach())
        elif written:
            part.stale = True  # an aborted step: the device copy's write is dropped with the step
        grads = [p.grad for p in store.params]
        for p, host_view, saved in zip(store.params, store.master_views, part.saved_grads):
            p.grad = None
            p.data = host_view
            p.grad = saved
        part.on_device = False
        if part is self.before and self.device_update is not None and self.device_update.applies(part, grads, then):
            self.updates.add(part.key, store, self.device_update.run(part, grads, then, part.priority))
        elif any(g is not None for g in grads):
            self.send(part.key, store, grads, then, part.priority)
            self.stats.bump(self.stats.d2h, part.key)

    def backward_starts(self, first: bool, block: int, then: Any) -> None:
        """A block's backward begins. At the first one of a micro-batch whose update overlaps it, the after
        part's gradients are final (the loss's backward, which alone reaches them, is done): send them home
        now, so that their update runs beside the blocks' backward instead of after it."""
        if first:
            self._blocks_backward_began = True
            self.refuse_untakeable_writes()
        part = self.after
        if (not first or part is None or not part.on_device or then is None or not self.after_follows_blocks
                or not self.after_watched):
            return
        calls = self.state.calls
        # one pass through the blocks, this one last: every use of the after part came after it
        if block != max(calls, default=-1) or any(n != 1 for n in calls.values()):
            return
        self._part_to_host(part, then)
        part.sent_early = True

    def end_backward(self, complete: bool = True) -> None:
        """A micro-batch's backward is over (``complete``: it ran to its end, so the after part was watched)."""
        for part in self.parts:
            part.sent_early = False
        if complete and self._blocks_backward_began:
            self.after_watched = True
        self._blocks_backward_began = False

    def _after_grad_landed(self, param: torch.Tensor) -> None:
        if self.after is None or not self._blocks_backward_began:
            return
        if self.after.sent_early:
            name = self._names.get(id(param), f"a parameter of shape {tuple(param.shape)}")
            raise RuntimeError(
                f"MegaTrainStrategy: {name} got a gradient after the blocks' backward had begun, so after its "
                "gradients had gone home and its update had started: this step used it before the blocks ran "
                "(a loss term on the weights computed before the forward?), which the steps before had not. "
                "Compute such a term after the forward in every step (or use the optimizer's weight_decay), or "
                "pass MegaTrainStrategy(engine=EngineConfig(overlap_optimizer=False)), which sends these "
                "gradients at the backward's end."
            )
        self.after_follows_blocks = False  # a term before the blocks: final only at the end of the backward

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for part in self.parts:
            part.device, part.frozen, part.views = None, None, []
