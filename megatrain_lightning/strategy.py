"""MegaTrainStrategy: a thin Lightning adapter over :class:`~megatrain_lightning.engine.StreamingEngine`.

The LightningModule never moves to the device. At setup its repeated blocks are found, every parameter
becomes a view of a flat fp32 host buffer, and the blocks' ``forward`` is replaced by a streaming one.
Each step then opens the engine (resident parameters onto the device, first blocks prefetched), runs
the user's step, and the precision plugin brings gradients home and steps the optimizer on the host.
This module knows nothing of CUDA streams; the engine knows nothing of Lightning.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Generator, Mapping, Sequence

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch.plugins.io.checkpoint_plugin import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from .auto_placement import AutoPlacement, plan_shape
from .blocks import find_blocks
from .checkpoint_io import ShardedCheckpointIO
from .config import EngineConfig
from .data_parallel import first_refusal, init_process_group, make_replicas
from .errors import CheckpointError, ConfigError
from .hardware import detect
from .engine import StreamingEngine
from .engine.wide_weights import NarrowRead, widen
from .attached import hook
from .engine.shared import tmpfs_room
from .init import initializer_for
from .optim import HostOptimizer, chain_zero_grad
from .precision import MegaTrainPrecision
from .setup_checks import (
    check_supported, experts_hint, experts_in_bf16, gradient_readers, host_memory_refusal, in_place_expert_bias,
    leaves_weights_alone, module_hooks_touch_weights, refuse_grad_hooks, refuse_running_statistics,
    unseen_in_place_kernels, writers_between_steps,
)

log = logging.getLogger(__name__)


class MegaTrainStrategy(ParallelStrategy):
    """Train models larger than device memory: host-resident fp32 state, blocks streamed through the device.

    Args:
        engine: the placement and overlap choices (slots, kept and cached blocks, offloaded inputs, host
            state, gradient buffers, host threads, overlap): :class:`~megatrain_lightning.config.EngineConfig`,
            documented there. Default: ``EngineConfig()``, whose placement fields are open: on one CUDA
            device the strategy chooses them from its measured first step (``auto_placement.py``; the
            result in :attr:`placement_summary`), elsewhere they are the streaming placement.
        block_class: the class (or class name, or several) of the blocks to stream, when automatic
            detection (Hugging Face decoder layers, a ``ModuleList`` of same-class blocks) is not wanted.
        device: the compute device; default: the Trainer's accelerator device (``cuda:0`` or ``cpu``).
        meta_init: build what ``configure_model`` creates on the meta device and materialise it block by
            block into the host store (peak host memory: the store plus about one block), initialised by
            the Hugging Face model's ``_init_weights`` or each module's ``reset_parameters()``. Values
            are drawn afresh, so they differ from an eager build with the same seed. Modules built in
            ``__init__`` are real already and are moved into the store as they are.
        checkpoint_io: how checkpoints are written; default :class:`~megatrain_lightning.checkpoint_io.ShardedCheckpointIO`
            (one ``torch.save`` file when small, a directory of checksummed safetensors shards when large;
            written atomically, verified at load; docs/checkpoints.md). Its ``tidy`` runs at setup on each
            ModelCheckpoint directory, removing what a hard kill of an earlier run left there.
        host_bound_warning: on a mixture of experts whose placement the strategy chooses, warn once (after the
            first micro-batch, as a ``PossibleUserWarning``) when the planner puts the chosen placement's step
            bound by the host optimizer or the link, naming the batch size or accumulation that would hide it.
            ``train.py`` turns it off: its plan already warned, or picked the micro-batch, at the start.
        accelerator, precision_plugin: as for any Lightning strategy; a precision plugin
            chosen by ``Trainer(precision=...)`` is converted to :class:`MegaTrainPrecision`.

    The overlap of the host optimizer (``EngineConfig.overlap_optimizer``) applies when it is exact: one
    optimizer, automatic optimisation, the last micro-batch of the window, no clipping, Adam on the fast
    path without step pre-hooks, and no ``on_after_backward``/``on_before_optimizer_step``/``optimizer_step``
    override. ``overlap_next_forward`` applies only while nothing but the engine can look at the weights
    between the steps: no hook of the module between steps, and no callback there other than Lightning's
    progress bars, checkpointing, LR monitor, timer, summary, early stopping and throughput monitor, this
    package's callbacks, or one that declares ``megatrain_reads_weights = False``. Checkpoints, validation
    and ``state_dict()`` always see the finished step.
    """

    strategy_name = "megatrain"

    def __init__(
        self,
        engine: EngineConfig | None = None,
        block_class: type | str | Sequence[type | str] | None = None,
        device: _DEVICE | None = None,
        meta_init: bool = True,
        skip_nonfinite: int = 0,
        host_bound_warning: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        # Default: sharded, atomic checkpoint directories (TorchCheckpointIO would hold a second copy of
        # all weights and optimizer state in memory while saving).
        checkpoint_io = ShardedCheckpointIO() if checkpoint_io is None else checkpoint_io
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=None)
        self._num_nodes = 1
        self.timeout = timedelta(minutes=30)
        if engine is not None and not isinstance(engine, EngineConfig):
            raise TypeError(f"engine={engine!r}: expected an EngineConfig (megatrain_lightning.EngineConfig)")
        self.config = engine or EngineConfig()
        if not isinstance(skip_nonfinite, int) or skip_nonfinite < 0:
            raise ValueError(f"skip_nonfinite={skip_nonfinite!r}: a number of consecutive steps, >= 0 (0: off)")
        self.skip_nonfinite = skip_nonfinite
        self.host_bound_warning = host_bound_warning
        self._torn: str | None = None  # why the module holds a mix of two steps (an exception mid-step)
        # id() of the exception last handled by _abort (not the exception: its traceback would keep the failed
        # step's frames, and the device tensors they hold, alive)
        self._aborted: int | None = None
        names = [block_class] if isinstance(block_class, (str, type)) or block_class is None else block_class
        if not isinstance(names, Sequence) or not all(isinstance(n, (str, type)) for n in names if n is not None):
            raise TypeError(f"MegaTrainStrategy(block_class={block_class!r}): expected a module class, its name, or "
                            "a list of them (block_class=\"LlamaDecoderLayer\"), or None to find the blocks")
        self.block_class = block_class
        self.meta_init = meta_init
        self._explicit_device = torch.device(device) if device is not None else None
        self.engine: StreamingEngine | None = None
        self.placement: AutoPlacement | None = None  # choosing an open placement (setup to teardown)
        self.placement_summary: dict[str, Any] | None = None  # what it chose, kept after teardown
        self._pending_model_state: tuple[Mapping[str, Any], bool] | None = None
        self.precision_plugin = precision_plugin  # type: ignore[assignment]

    # ------------------------------------------------------------------ ranks (data parallel)
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's connector: with several ranks it gives each a DistributedSampler."""
        return self.num_nodes * self.num_processes > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        if self.is_distributed:
            assert self.cluster_environment is not None
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.is_distributed:
            assert self.cluster_environment is not None
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
            rank_zero_only.rank = self.global_rank
            init_process_group(self.cluster_environment, self.root_device, self.timeout)

    @override
    def barrier(self, name: str | None = None) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ device and precision
    @property
    @override
    def root_device(self) -> torch.device:
        if self._explicit_device is not None:
            return self._explicit_device
        if self.parallel_devices:
            return self.parallel_devices[self.local_rank if len(self.parallel_devices) > 1 else 0]
        return torch.device("cpu")

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> MegaTrainPrecision:
        plugin = self._precision_plugin
        if plugin is None:
            plugin = self._precision_plugin = MegaTrainPrecision("32-true", self.root_device.type)
        assert isinstance(plugin, MegaTrainPrecision)
        return plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is None or isinstance(plugin, MegaTrainPrecision):
            self._precision_plugin = plugin
            return
        # The connector hands us the plugin it chose from Trainer(precision=...): translate it.
        name = getattr(plugin, "precision", "32-true")
        self._precision_plugin = MegaTrainPrecision(name, self.root_device.type)

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # configure_model builds on the meta device (no memory); setup materialises each block straight
        # into the host store and initialises it there. meta_init=False builds on the host instead.
        device = torch.device("meta") if self.meta_init and empty_init is not False else torch.device("cpu")
        with device, self.precision_plugin.tensor_init_context():
            yield

    @override
    def model_to_device(self) -> None:
        pass  # deliberate no-op: parameters stay host tensors; the engine streams them

    # ------------------------------------------------------------------ setup / teardown
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._tidy_checkpoint_dirs(trainer)
        module = self.lightning_module
        assert module is not None
        precision = self.precision_plugin
        precision.device_type = self.root_device.type
        check_supported(module, trainer)
        torn = module.__dict__.get("_megatrain_torn")
        if torn is not None and trainer.ckpt_path is None:
            rank_zero_warn(f"MegaTrainStrategy: {type(module).__name__}'s weights mix two steps ({torn}); this run "
                           "starts from them. Resume from a checkpoint (ckpt_path=...) to start from a whole step.")
        hint = experts_hint(module)
        if hint is not None:
            rank_zero_info(hint)
        apart = experts_in_bf16(module, str(trainer.precision))
        if apart is not None:
            rank_zero_warn(apart)
        readers = gradient_readers(module, trainer) if self.is_distributed and trainer.state.fn == TrainerFn.FITTING else []
        if readers:
            rank_zero_warn(
                f"MegaTrainStrategy under data parallel: each rank holds the node's averaged gradients of the stores it "
                f"owns only (p.grad is None for the others), so {', '.join(readers)} see a part of them on each rank "
                "(a gradient norm computed there is this rank's share, not the global one). Trainer(gradient_clip_val="
                "...) clips by the global norm; sum a norm's squares over the node's ranks, or train on one device, "
                "where a hook must see every gradient.")
        self._keep_whole_activations_for(in_place_expert_bias(module))
        liger = unseen_in_place_kernels(module)
        self._keep_whole_activations_for(liger, liger=True)
        if liger is not None and self.config.compile_blocks is None:  # its kernels are fused already
            self.config = dataclasses.replace(self.config, compile_blocks=False)
        named_blocks = find_blocks(module, self.block_class)
        blocks = [m for _, m in named_blocks]
        refuse_running_statistics(named_blocks)
        if trainer.state.fn == TrainerFn.FITTING:
            refuse_grad_hooks(named_blocks)
        # Flags off during fit, the user's settings back at teardown: Hugging Face's own checkpointing (the engine
        # recomputes every block), and Gemma4's copy of a layer's keys for later layers where no layer reads them
        # (num_kv_shared_layers=0: it would leave the block with a gradient history, refused by first_call)
        reused = any(getattr(m, "is_kv_shared_layer", False) for m in module.modules())
        self._switched_off = [(b, "gradient_checkpointing") for b in blocks if getattr(b, "gradient_checkpointing", False)]
        self._switched_off += [] if reused else [
            (m, "store_full_length_kv") for m in module.modules() if getattr(m, "store_full_length_kv", None) is True]
        for obj, attr in self._switched_off:
            setattr(obj, attr, False)
        module._apply(lambda t: t if t.is_meta else t.cpu())  # meta tensors are materialised below
        self._check_host_memory(module, blocks, trainer)
        # The store comes first: a meta-built model is materialised into it block by block, and the
        # optimizer must then be built on the materialised parameters.
        replicas = None
        if self.is_distributed:
            replicas = make_replicas(self.world_size, self.global_rank, self.num_processes, self.local_rank,
                                     self.node_rank)
        init = initializer_for(module)
        self.engine = StreamingEngine(
            module,
            blocks,
            device=self.root_device,
            compute_dtype=precision.compute_dtype,
            config=self.config.for_blocks(len(blocks)),
            init=init,
            replicas=replicas,
        )
        if init.drew_random() and not getattr(module, "meta_init_matches_eager", False):
            rank_zero_info(
                f"{type(module).__name__}.configure_model's modules were built on the meta device and initialised "
                "in the host store (MegaTrainStrategy(meta_init=True): peak host memory the store plus about one "
                "block). Their random values are drawn afresh by _init_weights / reset_parameters, so a seed gives "
                "other initial weights than an eager build under Lightning's default strategy, and the losses differ "
                "from the first step (the training is the same). MegaTrainStrategy(meta_init=False) builds them on "
                "the host as that strategy does."
            )
        if self._pending_model_state is not None:  # a checkpoint restored before setup
            pending, self._pending_model_state = self._pending_model_state, None
            self.load_model_state_dict(*pending)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        precision.attach(self.engine, {})
        self._bind_optimizers()
        precision.skip_nonfinite = self.skip_nonfinite
        precision.on_abort = self._abort
        self.engine.check_finite(self.skip_nonfinite > 0)
        self._torn = None
        # A placement left open is chosen from the measured first micro-batch, on one CUDA device while
        # fitting (auto_placement.py); elsewhere it is the streaming one (EngineConfig.filled).
        self.placement = None
        if (self.config.unset and self.root_device.type == "cuda" and trainer.state.fn == TrainerFn.FITTING
                and not self.is_distributed):
            hparams = getattr(module, "hparams", {})
            self.placement = AutoPlacement(self.engine, self.config, plan_shape(module),
                                           accumulate=trainer.accumulate_grad_batches,
                                           clip=bool(trainer.gradient_clip_val), hardware=detect,
                                           loss_chunk_tokens=hparams.get("loss_chunk_tokens"),
                                           mlp_chunk_tokens=hparams.get("mlp_chunk_tokens"), say=rank_zero_info,
                                           warn=self._warn_host_bound, model=type(module).__name__)
        precision.placement = self.placement
        self._hosts_bound = True  # from here on, optimizers set (again) are bound as they come (the setter)
        self.setup_precision_plugin()  # re-wraps the optimizers (through the setter)
        chain_zero_grad(module, self.engine.zero_grad)
        # a load_state_dict from anywhere (a callback, the user) writes the masters: device copies follow (a copy of
        # the module, deepcopy or pickle, gets no hook: attached.py)
        self._hooks = [module.register_load_state_dict_post_hook(hook(lambda *_: self._weights_written()))]
        # whether code other than the engine may write the weights between steps (then copies are refreshed)
        self._outside_writers = writers_between_steps(module, trainer)
        module._device = self.root_device  # LightningModule.device reports where the batches go

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        ParallelStrategy.optimizers.fset(self, optimizers)  # type: ignore[attr-defined]  # the wrappers
        if getattr(self, "_hosts_bound", False) and self.engine is not None:
            # set again (setup_precision_plugin), or replaced mid-fit (trainer.optimizers = ..., a callback's
            # strategy.setup_optimizers): the new ones are stepped on the host as the first were
            self._bind_optimizers()

    def _bind_optimizers(self) -> None:
        """A :class:`HostOptimizer` for each of the strategy's optimizers (those it has already are kept), and
        every zero_grad a user can reach chained to the engine's, which also clears the gradients the engine
        parks mid-step: the optimizer's (chained by HostOptimizer), its LightningOptimizer wrapper's (a
        subclass instance that does not forward zero_grad); the module's own is chained once, in setup."""
        engine = self.engine
        assert engine is not None
        precision = self.precision_plugin
        old = precision.host_optimizers
        hosts = {id(o): old[id(o)] for o in self.optimizers if id(o) in old and old[id(o)].optimizer is o}
        for host in old.values():
            if all(host is not h for h in hosts.values()):
                host.close()  # an optimizer replaced: its hooks and zero_grad chain go with it
        new = [o for o in self.optimizers if id(o) not in hosts]
        # what the optimizers hold trains, even if it does not require grad now (BaseFinetuning, GANs)
        if engine.make_trainable([p for o in new for g in o.param_groups for p in g["params"]]):
            for host in hosts.values():
                host.bind(engine.all_stores())
        for o in new:
            hosts[id(o)] = HostOptimizer(o, engine.all_stores(), engine.zero_grad,
                                         around_load=(self._settle, engine.weights_changed))
        precision.attach(engine, hosts)
        for wrapper in self._lightning_optimizers:  # new wrappers each time the optimizers are set
            chain_zero_grad(wrapper, engine.zero_grad)

    def _check_host_memory(self, module: pl.LightningModule, blocks: Sequence[torch.nn.Module], trainer: pl.Trainer) -> None:
        """Refuse, before the store allocates anything, a model whose host state cannot fit (setup_checks.py)."""
        distributed = self.is_distributed
        refusal = host_memory_refusal(module, blocks, self.config, trainer,
                                      ranks_per_node=self.num_processes if distributed else 1,
                                      tmpfs=tmpfs_room() if distributed else None)
        if distributed:
            # every rank has checked before any of them maps the node's store (which would shrink the
            # others' MemAvailable); one rank's refusal is every rank's, so none waits on the others
            refusal = first_refusal(refusal, self.world_size)
        if refusal is not None:
            raise ConfigError(refusal)

    def _keep_whole_activations_for(self, parts: str | None, liger: bool = False) -> None:
        """Code that changes matmul outputs in place (``in_place_expert_bias``; with ``liger``, Liger Kernel's
        fused kernels: ``unseen_in_place_kernels``) cannot have kept blocks save matmul outputs only: refused
        where asked for; where the placement is chosen, kept blocks keep all they save."""
        if parts is None or self.config.kept_saves == "all" or self.config.keep_activations == 0:
            return  # nothing kept saves matmul outputs
        if liger:
            what = ("write into matmul outputs and saved tensors in place, unseen by autograd, so torch's selective "
                    "recompute would give wrong gradients (1.44 relative on a 7B layer)")
            fix = ("leave the block's elementwise kernels to the strategy (compile_blocks: torch.compile fuses the same "
                   "norms, rotary embedding and SwiGLU) and apply Liger for its fused linear cross-entropy only "
                   "(rope=False, rms_norm=False, swiglu=False)")
        else:
            what = ("(transformers' grouped_mm experts with biases) then changes in place, which torch's selective "
                    "recompute refuses at the first backward")
            fix = ("set experts_implementation='grouped_mm_gather' (import megatrain_lightning.models; model."
                   "set_experts_implementation('grouped_mm_gather'): the same function, its bias added out of place)")
        if self.config.kept_saves == "matmuls":
            raise ConfigError(f"kept_saves='matmuls' saves matmul outputs that {parts} {what}: {fix}, or "
                              "kept_saves='all'")
        self.config = dataclasses.replace(self.config, kept_saves="all")
        rank_zero_info(f"kept_saves='all': {parts} {what}, so kept blocks cannot save matmul outputs only; to let "
                       f"the strategy choose, {fix}")

    def _tidy_checkpoint_dirs(self, trainer: pl.Trainer) -> None:
        """What a hard kill of an earlier run left in the ModelCheckpoint directories (hidden temporary
        siblings; a checkpoint moved aside mid-replace) is cleaned up at the start of this one."""
        tidy = getattr(self.checkpoint_io, "tidy", None)
        if tidy is None or not trainer.is_global_zero:
            return
        for cb in trainer.checkpoint_callbacks:
            dirpath = getattr(cb, "dirpath", None)
            if dirpath and "://" not in str(dirpath):
                tidy(dirpath)

    def _warn_host_bound(self, warning: str) -> None:
        """The automatic placement's warning that a mixture of experts is bound by host work (``host_bound_warning``)."""
        if self.host_bound_warning:
            rank_zero_warn(warning, category=PossibleUserWarning)

    def _weights_written(self) -> None:
        if self.engine is not None:
            self.engine.weights_changed()

    def _refresh_if_written(self) -> None:
        """Before a step: if anything but the engine may have written the weights since the last one (a hook
        or callback between steps, an optimizer step post-hook: weight clipping), take what it wrote
        (``engine.reclaim``; the copies an update on the device left there too). Without such hooks or
        callbacks this costs nothing: an optimizer step refreshes the other device copies anyway."""
        if self.engine is None:
            return
        if getattr(self, "_outside_writers", False) or any(
                h.has_post_hooks() for h in self.precision_plugin.host_optimizers.values()):
            self.engine.reclaim()

    @override
    def teardown(self) -> None:
        self._pending_model_state = None
        if self.placement is not None:
            self.placement_summary = self.placement.summary()
        self.placement = None
        self.precision_plugin.placement = None
        for obj, attr in getattr(self, "_switched_off", []):
            setattr(obj, attr, True)
        self._switched_off = []
        for h in getattr(self, "_hooks", []):
            h.remove()
        self._hooks = []
        self._hosts_bound = False
        for host in self.precision_plugin.host_optimizers.values():
            host.close()
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            self.precision_plugin.attach(None, {})
            if self.lightning_module is not None:
                self.lightning_module.__dict__.pop("zero_grad", None)  # undo chain_zero_grad
        # The base teardown would call module.cpu(): the module is on the host already, and after a
        # failed setup it may still hold meta tensors, which cannot be copied.
        if self.lightning_module is not None:
            self.lightning_module._device = torch.device("cpu")
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()

    # ------------------------------------------------------------------ steps
    @contextmanager
    def _step(self, wait: bool) -> Generator[None, None, None]:
        """One call of the user's step function; a training step (``wait=False``) has its backward to come."""
        engine = self.engine
        if engine is None:
            yield
            return
        engine.settle(wait=wait)  # a training step need not wait: each block awaits its own update
        engine.open_step()
        try:
            yield
        finally:
            engine.end_call(backward_follows=not wait)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.placement is not None:
            self.placement.before_micro_batch()  # may take a new placement (the engine is between steps)
        rng = self._rng_for_a_rerun()
        while True:
            read, stepped = None, self.precision_plugin.steps_run
            try:
                return self._training_step(*args, **kwargs)
            except NarrowRead as exc:
                if self.precision_plugin.steps_run != stepped:  # manual optimisation: the step cannot run again
                    exc.add_note(
                        "MegaTrainStrategy: an optimizer step of this training step had run before this block's first "
                        "call, so the training step cannot run again. Call every block once before the first "
                        "opt.step() of a training step (the first training step decides which weights stay fp32), or "
                        "train with precision='32-true'.")
                    raise
                read = exc
            except torch.OutOfMemoryError:
                if self.placement is None or not self.placement.can_back_off:
                    raise
            # Outside the except: the failed forward's frames, and the tensors they held, are gone. Nothing of
            # the step had been updated (the forward changes no weight): it runs again, whole, with the weights a
            # block's first call found read outside autocast's matmuls held in fp32 (engine/wide_weights.py), or
            # on a smaller placement (the streaming one at the last, which the measured first step ran on).
            if read is not None:
                self._widen(read)
            else:
                self.placement.out_of_memory()
            if rng is not None:
                _set_rng_states(rng)

    def _rng_for_a_rerun(self) -> dict | None:
        """While a block's first call is to come under a narrow compute dtype (it may find weights to widen: the step
        then runs again), the step's random state, so that the rerun draws what it drew (dropout) and trains as the
        default strategy's single run; else None (nothing collected)."""
        engine = self.engine
        if engine is None or engine.compute_dtype == torch.float32 or len(engine.checked_blocks) == len(engine.blocks):
            return None
        return _collect_rng_states()

    def _widen(self, read: NarrowRead) -> None:
        widened = widen(self.engine, read)
        names, numel = [n for n, _ in widened], sum(k for _, k in widened)
        log.info(
            "MegaTrainStrategy: %d weights (%s%s; %.2f MB in fp32) are read outside autocast's matmuls, or their "
            "dtype sets another tensor's (%s), where Lightning's bf16-mixed has them in fp32: kept in fp32 on the "
            "device from now on, as one-dimensional weights are, and the step runs again.",
            len(names), ", ".join(names[:3]), ", ..." if len(names) > 3 else "",
            numel * 4 / 1e6, ", ".join(sorted(set(read.ops))))

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._aborted = None  # a new attempt: an id seen by _abort before may belong to a new exception now
        self._sync_trainable()
        self._refresh_if_written()
        interrupts = self.precision_plugin.interrupts
        interrupts.arm()  # a Ctrl-C waits for the step's end (the optimizer step's, in automatic optimisation)
        try:
            with self._step(wait=False):
                if self.engine is not None:
                    host = self._overlap_target()
                    self.engine.on_grads_final = None  # the precision plugin's backward hands it the update
                    self.precision_plugin.overlap = host
                    self.precision_plugin.defer_updates = host is not None and self._may_defer(host)
                    self.engine.hold_updates(self.precision_plugin.defer_updates)
                out = super().training_step(*args, **kwargs)
        except BaseException as exc:
            interrupts.release()
            interrupts.drop()
            self._abort(exc)
            self._note_upcast(exc)
            raise
        interrupts.release()
        return out

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.precision_plugin.interrupts.deliver()  # a Ctrl-C held by the last step, now that it is counted
        super().on_train_batch_start(batch, batch_idx)

    @override
    def on_validation_start(self) -> None:
        self.precision_plugin.interrupts.deliver()
        super().on_validation_start()

    def _abort(self, exc: BaseException) -> None:
        """An exception ends the step: the engine cancels what had not started; if updates of the step had
        run, the weights are a mix of two steps and saving them is refused from now on (``_torn``)."""
        if self.engine is None or id(exc) == self._aborted:
            return
        self._aborted = id(exc)
        ran, failed = self.engine.abort_step()
        if (ran or failed) and self._torn is None:
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            step = trainer.global_step if trainer is not None else "?"
            what = f"{ran} of its host updates had run" + (f" and {failed} had failed" if failed else "")
            self._torn = (
                f"the step after global_step {step} was stopped by {type(exc).__name__}: {exc} after {what}, so "
                "the weights and optimizer state mix two steps"
            )
            # Said where the user looks (the exception) and kept on the module: a later fit, validate or test of
            # it warns at setup, unless it resumes from a checkpoint.
            note = (f"MegaTrainStrategy: {what} when this exception stopped the step, so the module's weights "
                    "and optimizer state now mix two steps (saving them is refused). Resume from the last "
                    "checkpoint (trainer.fit(..., ckpt_path='last')) rather than using this module as it is; "
                    "EngineConfig(overlap_optimizer=False) leaves a step's state whole under such exceptions.")
            exc.add_note(note)
            if isinstance(exc, KeyboardInterrupt):  # Lightning ends a fit on it with sys.exit: no traceback shows the note
                rank_zero_warn(note)
            if self.lightning_module is not None:
                self.lightning_module.__dict__["_megatrain_torn"] = self._torn

    def _note_upcast(self, exc: BaseException) -> None:
        """A dtype error in a model with trainable parameters given in bf16/fp16: they compute in fp32 here (their
        fp32 masters) beside weights kept narrow (frozen ones keep their dtype), so say which and what to change."""
        msg = str(exc)
        if (self.engine is None or not self.engine.upcast or not isinstance(exc, RuntimeError)
                or not any(s in msg for s in ("dtype", "BFloat16", "Half", "scalar type"))):
            return
        paths = {id(p): n for n, p in self.lightning_module.named_parameters()} if self.lightning_module else {}
        names = [paths.get(id(p), type(p).__name__) for p in self.engine.upcast]
        exc.add_note(
            f"MegaTrainStrategy: {len(names)} trainable parameters given in bf16/fp16 ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}) train as fp32 host masters and compute in fp32, beside weights "
            "kept in bf16/fp16 (frozen ones keep their dtype): an op that mixes the two fails as this one did. Cast "
            "the trainable ones to fp32 before fit (module.<name>.float(); peft's autocast_adapter_dtype=True does "
            "so for adapters), or train with precision='bf16-mixed'.")

    def _sync_trainable(self) -> None:
        """Before a step: parameters unfrozen or added to an optimizer since the last one (``BaseFinetuning``'s
        ``unfreeze_and_add_param_group``) get their place in the stores, and the optimizers see them."""
        if self.engine is None:
            return
        hosts = list(self.precision_plugin.host_optimizers.values())
        grouped = any(h.groups_changed() for h in hosts)
        if self.engine.make_trainable([p for h in hosts for p in h.params()] if grouped else ()) or grouped:
            for h in hosts:
                h.bind(self.engine.all_stores())

    def _overlap_target(self) -> HostOptimizer | None:
        """The host optimizer to run block by block during this backward, or None to step after it.

        Overlap is exact only when nothing may look at or change the gradients between the backward and
        the step: automatic optimisation, the last micro-batch of the window, no clipping, Adam on the
        fast path without step pre-hooks, and no user hook around the step.
        """
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if not self.config.overlap_optimizer or trainer is None or len(self.optimizers) != 1:
            return None
        if self.placement is not None and self.placement.trying:
            return None  # a step trying a placement may run out of memory: nothing updates before its end
        module = self.lightning_module
        if not module.automatic_optimization or trainer.gradient_clip_val:
            return None
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return None
        hooks = ("backward", "on_after_backward", "on_before_optimizer_step", "optimizer_step",
                 "configure_gradient_clipping")
        if any(is_overridden(h, module) for h in hooks):
            return None
        if any(is_overridden("on_before_optimizer_step", cb, pl.Callback) for cb in trainer.callbacks)\
                or any(is_overridden("on_after_backward", cb, pl.Callback) for cb in trainer.callbacks):
            return None
        host = self.precision_plugin.host_optimizers.get(id(self.optimizers[0]))
        return host if host is not None and host.can_overlap() else None

    def _may_defer(self, host: HostOptimizer) -> bool:
        """Whether this step's updates may run on into the next forward (``overlap_next_forward``): only
        while no hook of the module, and no callback not known to leave the weights alone, can run
        between the steps."""
        if not self.config.overlap_next_forward or not host.can_defer():
            return False
        module = self.lightning_module
        assert module is not None
        if module_hooks_touch_weights(module):
            return False
        return all(leaves_weights_alone(cb) for cb in module.trainer.callbacks)

    def _eval_step(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        """Validation, test and predict stream too; resident parameters go home right after."""
        self._settle()
        self._refresh_if_written()  # e.g. an EMA callback swapped the averaged weights in
        rng = self._rng_for_a_rerun()
        while True:
            try:
                with self._step(wait=True):
                    out = step(*args, **kwargs)
                break
            except NarrowRead as exc:  # a first call with a graph (inference_mode=False): as in training_step
                self._abort(exc)
                read = exc
            self._widen(read)
            if rng is not None:
                _set_rng_states(rng)
        self._settle()
        return out

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().predict_step, *args, **kwargs)

    def _settle(self) -> None:
        if self.engine is not None:
            self.engine.settle()

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Lightning's own order (before setup): only that path hands `fit(..., weights_only=...)` to
        # load_checkpoint (the after-setup one drops it, lightning 2.6). The module's on_load_checkpoint
        # and the callbacks' state run before setup, as under SingleDeviceStrategy; the weights wait in
        # load_model_state_dict until setup has built the host store.
        return False

    @override
    def on_train_end(self) -> None:
        self._settle()  # the last step's updates have run before fit returns
        self.precision_plugin.interrupts.deliver()

    def _refuse_if_torn(self) -> None:
        if self._torn is not None:
            raise CheckpointError(
                f"MegaTrainStrategy refuses to save: {self._torn}. A checkpoint of it would resume a model that "
                "no run trained; resume from the last checkpoint written before (its step is complete). Where an "
                "exception in the backward must leave a checkpoint (OnExceptionCheckpoint), "
                "MegaTrainStrategy(engine=EngineConfig(overlap_optimizer=False)) runs a step's updates only after "
                "its backward, as Lightning's default strategy does (slower: the host step no longer overlaps)."
            )

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        self._refuse_if_torn()
        self._settle()  # the moments and step counts of every update of the step
        host = self.precision_plugin.host_optimizers.get(id(getattr(optimizer, "_optimizer", optimizer)))
        if host is not None and self.is_distributed:
            host.share_states()  # the stores other ranks of the node update, in this rank's state dict too
        return super().optimizer_state(optimizer)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._refuse_if_torn()
        self._settle()  # resident parameters must be their host masters while the state is read
        return super().lightning_module_state_dict()

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        if self.engine is None and module is not None and _has_meta_tensors(module):
            # Before setup (see restore_checkpoint_after_setup) on a meta-built module, whose tensors would
            # drop the values: kept until setup has materialised the host store, then copied into its views.
            # Buffer lifetime: a reference to the loaded dict, dropped at setup (or teardown).
            self._pending_model_state = (checkpoint, strict)
            return
        self._settle()
        super().load_model_state_dict(checkpoint, strict=strict)  # copies into the master views (or the module)
        if module is not None:
            module.__dict__.pop("_megatrain_torn", None)  # whole again: a checkpoint's weights
        if self.engine is not None:
            self.engine.weights_changed()

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # Each load settles first (moments the device holds ahead of the host go home before the loaded ones
        # replace them); the loaded moments then move into the flat host buffers and the device copies are
        # refreshed: the host optimizer's load_state_dict hooks, as for a user's own call.
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Layer streaming with host-resident fp32 state and a host-side optimizer",
        )


def _has_meta_tensors(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())
