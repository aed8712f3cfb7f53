"""The autograd Function that runs one streamed block: forward keeps only its inputs, backward recomputes.

Forward runs the block under ``no_grad`` with its weights bound to a device slot, so no activation
inside the block outlives the call; only the block's tensor inputs are saved (on the device, or in
host memory when the engine offloads them). Backward re-streams the weights, restores the RNG and
autocast state of the forward (dropout masks match bit for bit), reruns the block with grad enabled,
and takes the gradients of its inputs and its parameters in one ``autograd.grad`` call; the parameter
gradients go to the engine, which ships them to the host.

A block the engine *keeps* runs its forward with grad enabled instead, on weights that stay in a fixed
device slot; its inner graph (its activations) lives in ``ctx`` until the backward, which then needs
neither a recompute nor a second weight copy. With ``kept_saves="matmuls"`` that graph holds only the
matmul and attention outputs, and the backward recomputes the elementwise ops (``selective.py``).

What a block's submodules *record* while it runs (Hugging Face's router logits, attentions:
``side_outputs.py``) leaves the block as extra outputs of the Function, after the block's own; the
recompute records them again with grad, so a loss built from them (the router's auxiliary loss) sends its
gradient into the block's weights exactly as without streaming.

The Function is handed the engine as a non-tensor argument (``runner``); it knows nothing of streams.
"""

from __future__ import annotations

import random
import weakref
from typing import Any, Protocol, Sequence

import torch
from torch.utils import _pytree as pytree

from . import side_outputs
from .selective import saving_matmuls

try:
    import numpy as np
except ImportError:  # torch runs without numpy
    np = None  # type: ignore[assignment]


class BlockRunner(Protocol):
    """What :class:`StreamedBlock` needs from the engine."""

    device: torch.device
    blocks: Sequence[torch.nn.Module]

    def acquire(self, block: int) -> Sequence[torch.Tensor]: ...

    def release(self, block: int) -> None: ...

    def offload_grads(self, block: int, grads: Sequence[torch.Tensor | None]) -> None: ...

    def backward_starts(self, block: int) -> None: ...

    def run_forward(self, block: int, args: tuple, kwargs: dict, matmuls_only: bool = False,
                    eager: bool = False) -> Any: ...

    def compiles(self, block: int, matmuls_only: bool = False) -> bool: ...

    def requires_grad_flags(self, block: int) -> Sequence[bool]: ...

    def keeps(self, block: int) -> bool: ...

    def saves_matmuls_only(self, block: int) -> bool: ...

    def stash(self, tensors: Sequence[torch.Tensor]) -> Any: ...

    def unstash(self, stash: Any) -> list[torch.Tensor]: ...

    meter: Any  # device_memory.StepMeter: what keeping a block would hold, measured around its recompute


class RecomputeState:
    """What a forward's result depends on beyond its inputs and weights, replayed in its recompute (a streamed
    block's; a chunked MLP's, ``models/chunked_mlp.py``): torch's RNG (dropout draws the same masks), Python's
    and numpy's global RNGs and the ``torch.Generator`` objects the block holds (its own draws repeat),
    autocast (it casts the same), and each submodule's plain attributes (int, float, bool, str, None, and lists
    or tuples of those): its ``training`` flag (a pass in eval mode inside a training step recomputes in eval
    mode), what the forward counts (a call counter it reads), peft's active adapter names (switched between
    two forwards of one step). After the replay each is where the forward had left it.

    Cost: about 45 us per forward on the host (numpy's ``get_state`` is half of it; a Llama layer's
    attributes a quarter)."""

    def __init__(self, device: torch.device, modules: Sequence[torch.nn.Module] = (),
                 generators: Sequence[torch.Generator] = ()) -> None:
        self.device = device
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.py_rng = random.getstate()
        self.np_rng = np.random.get_state() if np is not None else None
        self.generators = [(g, g.get_state()) for g in generators]
        self.attrs = _plain_attrs(modules)
        self.autocast: list[tuple[str, bool, torch.dtype]] = []
        for dev in {"cpu", device.type}:
            self.autocast.append((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))

    def replay(self) -> "_Replay":
        return _Replay(self)


class _Replay:
    def __init__(self, state: RecomputeState) -> None:
        self.state = state
        self._stack: list[Any] = []
        self._after: list[Any] = []  # the states to put back: Python's and numpy's RNG, generators, attributes

    def __enter__(self) -> None:
        st = self.state
        devices = [st.device] if st.cuda_rng is not None else []
        fork = torch.random.fork_rng(devices=devices, device_type="cuda")
        fork.__enter__()
        self._stack.append(fork)
        torch.set_rng_state(st.cpu_rng)
        if st.cuda_rng is not None:
            torch.cuda.set_rng_state(st.cuda_rng, st.device)
        self._after = [random.getstate(), np.random.get_state() if st.np_rng is not None else None,
                       [g.get_state() for g, _ in st.generators], _plain_attrs([m for m, _ in st.attrs], copy=False)]
        random.setstate(st.py_rng)
        if st.np_rng is not None:
            np.random.set_state(st.np_rng)
        for g, state in st.generators:
            g.set_state(state)
        for m, values in st.attrs:  # copies: a second replay (a retried backward) starts from the snapshot again
            m.__dict__.update({k: list(v) if type(v) is list else v for k, v in values.items()})
        for dev, enabled, dtype in st.autocast:
            ac = torch.autocast(device_type=dev, dtype=dtype, enabled=enabled)
            ac.__enter__()
            self._stack.append(ac)

    def __exit__(self, *exc: Any) -> None:
        while self._stack:
            self._stack.pop().__exit__(*exc)
        st = self.state
        py_rng, np_rng, generators, attrs = self._after
        random.setstate(py_rng)
        if np_rng is not None:
            np.random.set_state(np_rng)
        for (g, _), state in zip(st.generators, generators):
            g.set_state(state)
        for m, values in attrs:
            m.__dict__.update(values)


_REPLAYED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[list[torch.nn.Module], list[torch.Generator]]]" = \
    weakref.WeakKeyDictionary()


def replayed(block: torch.nn.Module) -> tuple[list[torch.nn.Module], list[torch.Generator]]:
    """The block's modules (their plain attributes) and the ``torch.Generator`` objects they hold, which its
    recompute replays as the forward saw them. Found at the block's first call, kept while it lives."""
    found = _REPLAYED.get(block)
    if found is None:
        modules = list(block.modules())
        generators = list({id(g): g for m in modules for g in m.__dict__.values()
                           if isinstance(g, torch.Generator)}.values())
        found = _REPLAYED[block] = (modules, generators)
    return found


_PLAIN = (int, float, bool, str, type(None))


def _plain(v: Any) -> bool:
    """A value the recompute replays: a number, flag, string or None (peft's active adapter name, a mode), or a
    list or tuple of them (peft's active adapters)."""
    return type(v) in _PLAIN or (type(v) in (list, tuple) and all(type(x) in _PLAIN for x in v))


def _plain_attrs(modules: Sequence[torch.nn.Module], copy: bool = True) -> list[tuple[torch.nn.Module, dict[str, Any]]]:
    """Each module's plain attributes; ``copy``: lists copied (the snapshot the recompute replays must not
    follow a later in-place change; the values put back after a replay are the objects themselves)."""
    return [(m, {k: list(v) if copy and type(v) is list else v for k, v in m.__dict__.items() if _plain(v)})
            for m in modules]


class StreamedBlock(torch.autograd.Function):
    """``apply(runner, block, spec, anchor, *tensors)`` -> flat output tensors.

    ``spec`` rebuilds ``(args, kwargs)`` from ``tensors`` (pytree). ``anchor`` is a scalar that
    requires grad, so the block's backward runs (and its parameters get gradients) even when none of
    its inputs requires grad (a frozen embedding, say).
    """

    @staticmethod
    def forward(ctx: Any, runner: BlockRunner, block: int, spec: Any, anchor: torch.Tensor, *tensors: torch.Tensor) -> Any:
        ctx.runner = runner
        ctx.block = block
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        ctx.kept = None
        ctx.stash = None
        if runner.keeps(block):
            # Kept activations: build the block's own graph now, on weights in its fixed slot.
            inputs = _leaf_inputs(tensors)
            weights = runner.acquire(block)
            leaves = _leaf_weights(weights, runner.requires_grad_flags(block))
            with torch.enable_grad():
                if runner.saves_matmuls_only(block) and not runner.compiles(block, matmuls_only=True):
                    # the weights stay in the block's fixed slot until its backward: the recompute reads them
                    calls: list[RecomputeState] = []

                    def run(*ins: torch.Tensor) -> Any:
                        a, kw = spec.rebuild(ins)
                        # eager both times: the selective recompute must run the very ops it saved from
                        if calls:  # the selective recompute, in the backward: it records nothing; torch's
                            # checkpoint replays torch's RNG and autocast, calls[0] the rest as well
                            with side_outputs.silenced(), calls[0].replay():
                                return runner.run_forward(block, a, kw, weights=leaves, eager=True)
                        calls.append(RecomputeState(runner.device, *replayed(runner.blocks[block])))
                        return runner.run_forward(block, a, kw, weights=leaves, eager=True)

                    out, recorded, side = side_outputs.capture(lambda: saving_matmuls(run, *_not_leaves(inputs)))
                else:  # every activation kept, or a compiled graph saving matmul outputs (compiled.py)
                    args, kwargs = spec.rebuild(_not_leaves(inputs))
                    matmuls_only = runner.saves_matmuls_only(block)
                    out, recorded, side = side_outputs.capture(
                        lambda: runner.run_forward(block, args, kwargs, weights=leaves, matmuls_only=matmuls_only))
            runner.release(block)
        else:
            ctx.recompute = RecomputeState(runner.device, *replayed(runner.blocks[block]))
            args, kwargs = spec.rebuild(tensors)
            out, recorded, side = side_outputs.capture(lambda: runner.run_forward(block, args, kwargs))
        flat_out, out_spec = pytree.tree_flatten(out)
        ctx.out_tensor_idx = [i for i, o in enumerate(flat_out) if isinstance(o, torch.Tensor)]
        spec.set_output(flat_out, out_spec, ctx.out_tensor_idx, recorded)
        # The block's output tensors, then what its submodules recorded (router logits): extra outputs, so
        # that a loss built from them (the router's auxiliary loss) sends its gradient into this backward.
        outs = tuple(flat_out[i] for i in ctx.out_tensor_idx) + tuple(side)
        if runner.keeps(block):
            ctx.kept = (list(outs), inputs, leaves)  # the graph's lifetime: until this block's backward
            outs = tuple(o.detach() for o in outs)
        else:
            stash = runner.stash(tensors)
            if stash.host:
                ctx.stash = stash  # the residual stream went to host memory
            else:
                ctx.save_for_backward(*tensors)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx: Any, *grad_outs: torch.Tensor | None) -> Any:
        runner: BlockRunner = ctx.runner
        if torch.is_grad_enabled():  # a backward with create_graph=True
            raise RuntimeError(
                f"MegaTrainStrategy cannot train block {ctx.block} ({type(runner.blocks[ctx.block]).__name__}) "
                "exactly: a gradient is taken through it with create_graph=True (a gradient penalty, a "
                "second-order method), and a streamed block's backward returns its gradients without a graph, so "
                "their own gradient would be lost. Take such a gradient only through the resident modules "
                "(embeddings, head), or train this model with another strategy.")
        runner.backward_starts(ctx.block)
        flags = runner.requires_grad_flags(ctx.block)
        if ctx.kept is not None:
            outs, inputs, leaves = ctx.kept
            ctx.kept = None
        else:
            saved = runner.unstash(ctx.stash) if ctx.stash is not None else ctx.saved_tensors
            ctx.stash = None
            inputs = _leaf_inputs(saved)
            weights = runner.acquire(ctx.block)
            leaves = _leaf_weights(weights, flags)
            before = runner.meter.mark()
            with torch.enable_grad(), ctx.recompute.replay():
                args, kwargs = ctx.spec.rebuild(_not_leaves(inputs))
                out, side = side_outputs.recompute(
                    ctx.spec.recorded, lambda: runner.run_forward(ctx.block, args, kwargs, weights=leaves), ctx.block)
            runner.meter.built(before)  # what keeping this block's activations would hold
            flat_out = pytree.tree_leaves(out)
            outs = [flat_out[i] for i in ctx.out_tensor_idx] + side
        diff_inputs = [t for t in inputs if t.requires_grad]
        grad_leaves = [w for w in leaves if w.requires_grad]
        pairs = [(o, g) for o, g in zip(outs, grad_outs) if g is not None and o.requires_grad]
        targets = diff_inputs + grad_leaves
        if pairs and targets:
            try:
                grads = torch.autograd.grad(
                    [o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True
                )
            except RuntimeError as err:
                if "selective activation checkpoint has been mutated" in str(err):
                    raise RuntimeError(
                        f"MegaTrainStrategy cannot train block {ctx.block} ({type(runner.blocks[ctx.block]).__name__}) "
                        "with kept_saves='matmuls': its forward changes a matmul's output in place (h.mul_(...) after a "
                        "Linear), and the kept block's backward reads the output as it was saved. Use "
                        "EngineConfig(kept_saves='all') (or keep_activations=0) for this model.") from err
                if "use_reentrant=True" not in str(err):
                    raise
                raise RuntimeError(
                    f"MegaTrainStrategy cannot train block {ctx.block} ({type(runner.blocks[ctx.block]).__name__}): "
                    "its forward calls torch.utils.checkpoint with use_reentrant=True, which refuses "
                    "torch.autograd.grad, and a streamed block's backward takes its gradients with it. Pass "
                    "use_reentrant=False (the same gradients; the strategy recomputes the block in the backward "
                    "anyway, so a checkpoint inside it saves no more memory), or stream another level with "
                    "block_class=...") from err
        else:
            grads = (None,) * len(targets)
        # Slot lifetime: the backward's kernels are queued; the slot is free once they have run.
        runner.release(ctx.block)
        it = iter(grads[len(diff_inputs) :])
        param_grads = [next(it) if f else None for f in flags]
        runner.offload_grads(ctx.block, param_grads)
        in_it = iter(grads[: len(diff_inputs)])
        input_grads = [next(in_it) if t.requires_grad else None for t in inputs]
        return (None, None, None, None, *input_grads)


def _leaf_inputs(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().requires_grad_(t.requires_grad and t.is_floating_point()) for t in tensors]


def _not_leaves(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    # What the block is called with: views of the leaves the gradients are taken for. Autocast casts a leaf that
    # requires grad once per region (its cast cache), so the gradients of the matmuls reading it (BERT's query, key
    # and value read the block's input) would meet in bf16 before the cast's backward; under Lightning the block's
    # input is no leaf, each cast is its own, and they meet in fp32 (BERT, 4 layers, 1 step: 3.0e-5 in its embeddings).
    return [t.view_as(t) if t.requires_grad else t for t in inputs]


def _leaf_weights(weights: Sequence[torch.Tensor], flags: Sequence[bool]) -> list[torch.Tensor]:
    return [w.detach().requires_grad_(f) for w, f in zip(weights, flags)]


class CallSpec:
    """Pytree structure of one block call: tensors travel through autograd, the rest is kept here."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        flat, self.tree = pytree.tree_flatten((args, kwargs))
        self.tensor_idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        self._tensors: list[torch.Tensor] | None = [flat[i] for i in self.tensor_idx]
        # The spec lives as long as the graph: it must not hold the input tensors, or an offloaded
        # input would stay on the device anyway. They go through autograd (``take_tensors``).
        self.flat = [None if isinstance(x, torch.Tensor) else x for x in flat]
        self.out_flat: list[Any] = []
        self.out_tree: Any = None
        self.out_idx: list[int] = []
        self.recorded: side_outputs.Recorded | None = None  # what the call recorded (router logits), if anything

    def take_tensors(self) -> list[torch.Tensor]:
        """The call's tensors, handed over once: afterwards the spec holds no reference to them."""
        tensors, self._tensors = self._tensors, None
        if tensors is None:
            raise RuntimeError("CallSpec.take_tensors() called twice")
        return tensors

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple, dict]:
        flat = list(self.flat)
        for i, t in zip(self.tensor_idx, tensors):
            flat[i] = t
        args, kwargs = pytree.tree_unflatten(flat, self.tree)
        return args, kwargs

    def set_output(self, flat_out: list[Any], out_tree: Any, idx: list[int],
                   recorded: side_outputs.Recorded | None = None) -> None:
        # Non-tensor leaves of the output (None, ints) are kept; tensors are dropped here so that the
        # spec, which lives as long as the graph, does not hold the block's output alive.
        self.out_flat = [None if isinstance(o, torch.Tensor) else o for o in flat_out]
        self.out_tree = out_tree
        self.out_idx = idx
        self.recorded = recorded

    def rebuild_output(self, outs: Sequence[torch.Tensor]) -> Any:
        """The block's output from the Function's outputs; the extra ones after it (what the block's
        submodules recorded) go back into the recording collector, in their places."""
        n = len(self.out_idx)
        if self.recorded is not None:
            self.recorded.put_back(outs[n:])
        flat = list(self.out_flat)
        for i, t in zip(self.out_idx, outs[:n]):
            flat[i] = t
        return pytree.tree_unflatten(flat, self.out_tree)
