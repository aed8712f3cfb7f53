"""The streaming engine: the facade that wires store, slots, streams, gradient path and host worker.

Data flow of one micro-batch (DESIGN.md section 4):

* forward: block ``i`` waits for its weights in a slot (``prefetch.py``), runs without keeping
  activations (``block.py``), frees the slot; meanwhile the host->device stream fills the other slots
  with the next blocks of the predicted call order. The resident parameters (``resident.py``) are on the
  device for the step.
* backward: blocks in reverse; each is recomputed from its saved input (``offload.py`` when parked on the
  host) with re-streamed weights, and its gradients go home through ``grads.py``, where the host worker
  (``host_worker.py``) accumulates them or runs the block's optimizer update as soon as they land
  (``updates.py`` tracks those); the embedding and the first block may update on the device (``device_update.py``).
* options that spend device memory for speed (``EngineConfig``): kept blocks build their graph in the
  forward and skip the recompute; cached blocks own a fixed slot filled once per optimizer step.

Ordering is by events only; the one host synchronisation per micro-batch is at the end of the backward,
where the host optimizer needs the gradients. On a machine without CUDA the same code runs with the CPU
as the device (``streams.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from .. import host_cores, host_memory
from ..config import EngineConfig, grad_buffers_for
from . import params as _params, placement as _placement
from ..attached import method_of
from .block_call import run_bound, streamed_forward
from .compiled import CompiledBlocks, compiles_by_default
from .device_memory import StepMeter
from .grads import GradPath, Update
from .host_worker import HostWorker
from .materialize import InitFn, MetaMaterializer, before_blocks, build_stores, finish_stores, place_stores
from .offload import Stash
from .phase import Phase, StepState
from .replicas import Replicas
from .resident import ResidentParts, resident_names
from .device_update import DeviceUpdate
from .slots import BlockBinding
from .stats import EngineStats
from .host_buffers import PinnedRegistry
from .store import FlatStore
from .streams import Streams
from .updates import UpdateTracker


class StreamingEngine:
    """Streams ``blocks`` through device slots; everything else is resident during a step.

    Args:
        root: the whole model. Its parameters outside ``blocks`` are resident: on the device during a
            step (fp32 copies of their host masters), on the host otherwise.
        blocks: the repeated blocks of ``root``, in their usual forward order. Their ``forward`` is
            replaced by a streaming one for the engine's lifetime (:meth:`close` restores it).
        device: the compute device; the CPU runs the very same path (copies are plain copies).
        compute_dtype: dtype of the block weights on the device (bf16 halves slot memory and runs matmuls
            on tensor cores); masters and gradients stay fp32 on the host either way.
        config: placement and overlap choices (:class:`~megatrain_lightning.config.EngineConfig`).
        init: fills the tensors of modules built on the meta device, which the engine materialises block
            by block straight into the host store (``materialize.py``); required only for meta tensors.
        replicas: this rank's place under data parallel (``replicas.py``); None: one rank.
    """

    def __init__(self, root: nn.Module, blocks: Sequence[nn.Module], device: torch.device,
                 compute_dtype: torch.dtype = torch.float32, config: EngineConfig | None = None,
                 init: InitFn | None = None, replicas: Replicas | None = None) -> None:
        config = (config or EngineConfig()).filled()  # a placement nobody chose: streaming (config.STREAMING)
        for name in ("keep_activations", "cache_weights"):
            if getattr(config, name) > len(blocks):
                raise ValueError(f"{name}={getattr(config, name)}: more than the model's {len(blocks)} blocks")
        self.config, self.device, self.compute_dtype = config, torch.device(device), compute_dtype
        self.streams = Streams(self.device)
        self.meter = StepMeter(self.device)  # made before the engine allocates anything on the device
        self.replicas = replicas or Replicas()
        dp = self.replicas.parallel
        self.pins = PinnedRegistry(self.streams.cuda if config.pin_memory is None else config.pin_memory,
                                   self.replicas.arena)
        self.stats, self.state = EngineStats(), StepState()
        self.updates = UpdateTracker(self.stats, self.replicas)
        self.root, self.blocks = root, list(blocks)

        # The host store: a meta-built model is materialised into it block by block, in the module's own
        # order (what precedes the blocks, an embedding, first: the resident store is laid out first), so
        # that a seed gives the weights it gives under Lightning's default strategy.
        materializer = MetaMaterializer(init)
        write = self.replicas.local_rank == 0  # a node's other ranks map its store, the first one fills it
        names = resident_names(root, self.blocks)

        def resident_groups() -> list[list[nn.Parameter]]:
            return [[root.get_parameter(n) for n in group] for group in names]

        resident_buffers = place_stores(resident_groups(), materializer, self.pins, config.host_state,
                                        names=["r0", "r1"] if dp else None, write=write)
        for part in before_blocks(root, self.blocks):
            materializer(part)
        self.stores: list[FlatStore] = []
        self.bindings: list[BlockBinding] = []
        for i, block in enumerate(self.blocks):
            store = build_stores(block, lambda b=block: [list(b.parameters())], materializer, self.pins, config.host_state,
                                 names=[f"b{i}"] if dp else None, write=write)[0]
            assert store is not None  # find_blocks returns blocks with parameters
            self.stores.append(store)
            self.bindings.append(BlockBinding(block, store.params))
            self.bindings[-1].buffers_to(self.device)
        resident_stores = finish_stores(root, resident_groups, materializer, self.pins, config.host_state,
                                        resident_buffers, skip={id(b) for b in self.blocks})
        self.resident = ResidentParts(root, self.blocks, resident_stores, self.streams, self.stats, self.updates,
                                      self.state, self._send)
        if self.upcast:
            _params.upcast_buffers(self)
        if dp:  # every rank of the node has mapped its store: consistent across nodes, then unnamed
            self.replicas.node_barrier()
            self.replicas.from_global_zero([t for s in self.all_stores() for t in s.shared_buffers()])
            self.replicas.node_barrier()
            self.replicas.arena.seal()
            self.updates.remote = {key: s for key, s in self.keyed_stores() if not self.owns(key)}

        # Device slots and what streams into them.
        _placement.lay_out(self, config)

        # The gradient path and the host worker behind it.
        self.grad_buffers = grad_buffers_for(config.grad_buffers, self._host_need_with_own_accumulators(),
                                             host_memory.total_bytes())
        self.worker = HostWorker(threads=config.host_threads or host_cores.worker_threads())
        self.grads = GradPath(self.streams, self.grad_numel(), self.pins, self.stats, self.worker,
                              self.grad_buffers, max(s.train_numel for s in self.stores),
                              False if dp else config.bf16_grads,  # reduced in fp32
                              replicas=self.replicas)
        self.device_update = self.resident.device_update = DeviceUpdate(self)  # while config.update_on_device
        self.on_grads_final: Update | None = None  # per micro-batch, by the caller: a store's update

        self._anchor_t: torch.Tensor | None = None
        self.checked_blocks: set[int] = set()  # blocks whose first forward was checked for buffer updates
        auto = config.compile_blocks is None  # on CUDA under mixed precision (compiled.py)
        self.compiled = CompiledBlocks(compiles_by_default(self.device, compute_dtype) if auto else config.compile_blocks,
                                       self.checked_blocks, blocks, auto)
        self.outside = _params.OutsideUse(self.state, self.stores, self.blocks, self.replicas.parallel)
        self.original_forwards: dict[int, Callable[..., Any]] = {i: type(b).forward for i, b in enumerate(self.blocks)}
        for i, block in enumerate(self.blocks):  # a copy of the block (deepcopy) gets its class's forward: ../attached.py
            block.forward = method_of(block, "forward", streamed_forward(self, i, block, type(block).forward))  # type: ignore

    def place(self, config: EngineConfig) -> None:
        """Between steps, the placement fields of ``config`` from now on (``placement.replace``: a sync point)."""
        _placement.replace(self, config)

    def _host_need_with_own_accumulators(self) -> float:
        """Host bytes in use once every store holds its own fp32 accumulator and Adam moments."""
        need = host_memory.total_bytes() - host_memory.available_bytes()
        for s in self.all_stores():
            need += 4 * s.train_numel if s.grad is None else 0
            need += 2 * s.train_numel * s.dtype.itemsize if s.exp_avg is None else 0
        return need

    def grad_numel(self) -> int:
        """Elements of the gradient path's slabs: the largest trainable region of any store."""
        return max(16, max(s.train_numel for s in self.all_stores()))

    @property
    def upcast(self) -> list[nn.Parameter]:
        """Trainable parameters that were given in bf16/fp16 and now live as fp32 masters."""
        return [p for s in self.all_stores() for p in s.upcast]

    # ------------------------------------------------------------------ step scope
    def open_step(self) -> None:
        """Enter a step: resident weights go to the device and the first blocks start streaming in."""
        self.state.open()
        self.meter.begin()
        self.updates.begin_step()
        self.resident.open()
        self.weights.start()

    def end_call(self, backward_follows: bool = True) -> None:
        """The user's step function returned. Until its backward is done (``finish_backward``) blocks still
        stream (a user's activation checkpoint recomputes them there); with no backward to follow (an
        evaluation step), blocks called from now on run on the host."""
        self.state.close(backward_follows)

    def finish_backward(self) -> None:
        """After ``loss.backward()``: resident gradients home, one host sync, host grads attached.

        Sync point: waits for every device->host gradient copy and the host worker's accumulation jobs.
        """
        self.resident.to_host(self.on_grads_final)
        self.grads.drain()
        if self.streams.cuda:
            self.streams.h2d.synchronize()  # no copy may still read a master the optimizer will write
        self.resident.end_backward()
        self.outside.sent = set()
        self.weights.learn(self.state.end_micro_batch())
        self.offload.reset()
        self.meter.end()

    def settle(self, wait: bool = True) -> None:
        """Resident parameters back to their host masters (gradients included), gradients drained and,
        with ``wait``, every overlapped update run.

        ``wait=False`` lets the updates run on: each store's next trip to the device waits for its own
        update, so the next forward starts as soon as its first blocks are updated. Nothing else may read
        or write the host masters, moments or ``.grad`` of the stores meanwhile: call ``settle()`` first.
        A step may go on after it (manual optimisation): the next module that owns a resident parameter
        pulls its part onto the device again.
        """
        self.resident.to_host(self.on_grads_final)
        self.grads.drain()
        if not self.state.step_open and self.state.phase is Phase.FORWARD:
            self.state.end_micro_batch()  # a step whose backward never came (its loss was None)
        if wait:
            self.wait_updates()
        else:
            self.on_grads_final = None

    def abort_step(self) -> tuple[int, int]:
        """An exception ends the step in flight (or a KeyboardInterrupt that could not wait): the step's
        updates not yet started are cancelled, the others waited for, every buffer lent to them goes back,
        the resident parameters go home and the stash is dropped, so that the next step (or a checkpoint)
        finds a consistent engine. Returns (how many of the step's updates ran, how many updates of any
        step failed): (0, 0) means the masters and moments are exactly the state before the step; anything
        else a mix of two steps (the caller refuses to save it)."""
        ran, failed = self.updates.abort_step()
        failed += not self.device_update.home_after_abort()  # what ran on the device counts as run: it goes home
        self.meter.restart()
        self.grads.abort()
        for store in self.all_stores():
            store.drop_half_grad()
        self.resident.to_host(None, keep_writes=False)
        self.resident.end_backward(complete=False)
        self.offload.reset()
        self.state.end_micro_batch()
        self.state.step_open = False
        self.outside.sent = set()
        self.on_grads_final = None
        self.weights_changed()
        return ran, failed

    def check_finite(self, on: bool) -> None:
        """Check every store's gradients on the device before they leave (``gradients_finite``), and have
        early updates refuse non-finite ones."""
        self.grads.check_finite = on

    def gradients_finite(self) -> bool:
        """Whether every gradient since the last call was finite (host sync; see ``check_finite``)."""
        return self.grads.gradients_finite()

    def wait_updates(self) -> None:
        """Host sync point: the overlapped optimizer updates of this step have all run."""
        self.on_grads_final = None
        self.updates.wait_all()  # raises what an update raised
        self.device_update.home()  # host sync: what the device updated is home (device_update.py)

    def hold_updates(self, hold: bool) -> None:
        """Before a step: whether its updates on the device may keep their newer state there (the step's end
        does not read the host state: ``settle(wait=False)``), or send it home as each one runs."""
        self.device_update.hold = hold

    def host_step_begins(self, claimed: set[int]) -> None:
        """The optimizer step is about to update on the host every store but ``claimed`` (updated early):
        those whose newer state is on the device go home first (host sync; only after the updates on the
        device stop applying to a store, e.g. a placement or accumulation change)."""
        self.device_update.home(keep=claimed)

    def take_claimed(self) -> set[int]:
        """Ids of the stores whose update was handed to ``on_grads_final`` since the last call: the
        caller's optimizer step must skip them (they are updated, or will be before they are used)."""
        return self.updates.take_claimed()

    def weights_changed(self) -> None:
        """The host masters were updated (optimizer step, checkpoint load): device copies are stale."""
        self.weights.invalidate()
        self.device_update.stale()  # first: it reads the resident parts' ``updated_on_device``
        self.resident.stale()

    def make_trainable(self, params: Sequence[nn.Parameter] = ()) -> bool:
        """See :func:`~megatrain_lightning.engine.params.make_trainable`."""
        return _params.make_trainable(self, params)

    def reclaim(self) -> None:
        """See :func:`~megatrain_lightning.engine.params.reclaim`."""
        _params.reclaim(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's ``zero_grad`` is about to run. An update still running on from the last step
        reads the gradients it would clear: wait for those first (normally done: the forward awaited them).
        Mid-step (Lightning zeroes after the forward of a window's first micro-batch) the resident
        parameters' host gradients are parked, out of its reach: clear them here as it would have."""
        if self.updates.pending():
            self.updates.wait_all()
        self.resident.zero_grad(set_to_none)

    # ------------------------------------------------------------------ blocks (BlockRunner)
    def anchor(self) -> torch.Tensor:
        """A scalar that requires grad, input of every StreamedBlock: its backward runs even when no
        other input of the block needs a gradient."""
        if self._anchor_t is None:
            self._anchor_t = torch.zeros((), device=self.device, requires_grad=True)
        return self._anchor_t

    def acquire(self, block: int) -> list[torch.Tensor]:
        return self.weights.acquire(block)

    def release(self, block: int) -> None:
        self.weights.release(block)

    def run_forward(self, block: int, args: tuple, kwargs: dict, weights: Sequence[torch.Tensor] | None = None,
                    matmuls_only: bool = False, eager: bool = False) -> Any:
        """Block ``block``'s own forward with its parameters bound to ``weights`` (acquired if None)."""
        return run_bound(self, block, args, kwargs, weights, matmuls_only, eager)

    def compiles(self, block: int, matmuls_only: bool = False) -> bool:
        """Whether ``block``'s next call runs compiled (``compiled.py``)."""
        return self.compiled.runs(block, self.original_forwards[block], matmuls_only)

    def requires_grad_flags(self, block: int) -> Sequence[bool]:
        """Read at each call (toggle_optimizer, unfreezing): which of the block's weights get gradients."""
        return [p.requires_grad for p in self.stores[block].params]

    def keeps(self, block: int) -> bool:
        """Whether ``block`` keeps its activations (no recompute) during a step."""
        return block in self.keep

    def saves_matmuls_only(self, block: int) -> bool:
        """Whether kept ``block`` saves only matmul and attention outputs (``kept_saves="matmuls"``)."""
        return self.config.kept_saves == "matmuls"

    def stash(self, tensors: Sequence[torch.Tensor]) -> Stash:
        return self.offload.stash(tensors, self.state.step_open, self.state.recorded[-1])  # the block being called

    def unstash(self, stash: Stash) -> list[torch.Tensor]:
        return self.offload.unstash(stash)

    def backward_starts(self, block: int) -> None:
        first = self.state.begin_backward()
        self.resident.backward_starts(first, block, self.on_grads_final)

    def offload_grads(self, block: int, grads: Sequence[torch.Tensor | None]) -> None:
        final = self.state.backward_call(block)  # a block called twice is final after its second backward
        then = self.on_grads_final if final and block not in self.outside.blocks else None  # outside: after it
        if self.device_update.applies_block(block, grads, then):  # see device_update.device_blocks
            self.updates.add(block, self.stores[block], self.device_update.run_block(block, grads, then))
        else:
            self._send(block, self.stores[block], grads, then, block)
        self.outside.sent.add(block)
        self.stats.bump(self.stats.d2h, block)

    def owns(self, key: int) -> bool:
        """Whether this rank updates store ``key`` (a block index, ``RESIDENT`` or ``RESIDENT_AFTER``)."""
        return self.replicas.owns(key if key >= 0 else len(self.stores) - 1 - key)

    def not_owned(self) -> set[int]:
        """Ids of the stores another rank of the node updates (data parallel; empty on one rank)."""
        return {id(s) for key, s in self.keyed_stores() if not self.owns(key)}

    def step_done(self, claimed: set[int]) -> None:
        """The optimizer step is complete on this rank (an exception before the next opens is not its: abort_step); the
        stores it updated itself (not ``claimed`` by an early update, which publishes its own) go to the node's other ranks."""
        self.updates.begin_step()
        if self.replicas.parallel:
            for key, store in self.keyed_stores():
                if self.owns(key) and id(store) not in claimed:
                    store.publish()
            self.replicas.steps += 1

    def _send(self, key: int, store: FlatStore, grads: Sequence[torch.Tensor | None], then: Update | None,
              priority: int) -> None:
        if then is not None:
            self.device_update.home(only=store)  # held on the device by an earlier step: its host update reads it
        # The worker runs jobs in the next forward's order: blocks by index, the resident parts around them.
        fut = self.grads.send(store, grads, then, priority=priority, owner=self.owns(key))
        if fut is not None:
            self.updates.add(key, store, fut)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Restore the blocks' own ``forward``, drop device memory and unpin the host buffers.

        The parameters stay views of the (now pageable) host buffers: the trained values.
        """
        self.settle()
        self.grads.close()
        self.worker.shutdown()
        for block in self.blocks:
            block.__dict__.pop("forward", None)
        self.compiled.close()
        self.outside.close()
        self.resident.close()
        if self.streams.cuda:
            torch.cuda.synchronize(self.device)
        self.weights.close()  # device memory goes now, not when the last reference to the engine does
        self.pins.close()

    def keyed_stores(self) -> list[tuple[int, FlatStore]]:
        """(key, store) of every store: block indices, then ``RESIDENT`` / ``RESIDENT_AFTER``."""
        return list(enumerate(self.stores)) + [(part.key, part.store) for part in self.resident.parts]

    def all_stores(self) -> list[FlatStore]:
        return self.stores + [part.store for part in self.resident.parts]
