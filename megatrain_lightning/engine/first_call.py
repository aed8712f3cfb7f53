"""A block's first forward, checked: what a streamed block cannot do and still train exactly.

A streamed block runs its forward without a graph and recomputes it in the backward from its saved inputs,
then takes the gradients of its inputs and of the weights it is streamed with in one ``autograd.grad``
(``block.py``). Under Lightning's default strategy the same module would run once, with a graph. Where the two
differ the result would be silently wrong, so the block's first call (eager, before any update, ``run_bound``)
runs with a graph as its recompute will, and refuses by name, in one paragraph with the fix, a block that

* reads a trainable parameter beyond its inputs and its own weights (a resident one through a plain
  attribute): no gradient would reach it;
* keeps a tensor of its forward with a gradient history beyond its outputs: a forward hook's list, an attribute
  such as ``self.aux_loss`` (a loss built from it would send no gradient into the block), a container passed to it
  that it writes into (Gemma3n's ``shared_kv_states``: a later block would read the keys as constants);
* has a gradient hook on one of its parameters (``register_hook``, ``register_post_accumulate_grad_hook``):
  the block's gradients reach the host accumulator without autograd on the parameter, so it would not run;
* changes its input tensors or its buffers in place: the recompute starts from the saved inputs and buffers.

Cost: the call builds the graph the recompute builds, once per block, without its saved tensors (the graph is
only walked: its activations are freed as they would be without it). Under ``torch.inference_mode`` (validate,
test, predict) only the narrow weights' reads below are looked for (once per block, with a graph outside it). What
transformers records (router logits: ``side_outputs.py``) leaves the collector detached: the Function returns it.

Under a narrow compute dtype the same graph shows the weights an op outside autocast's matmuls reads, and a few
more runs of the forward and backward (two, then one per weight of two or more dimensions, from one random
state; once per class of block and training mode; not for a block handed a KV cache; each run starts from the
containers it is handed as the call found them and leaves them as the call did, ``call_containers.py``; its forward
hooks run too) those whose dtype changes what it computes (``wide_weights.py``): the call raises ``NarrowRead``,
for the step to run again with them held in fp32.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import side_outputs
from .call_containers import FIX as _FIX
from .call_containers import Snapshot, containers, holds_a_cache, tensors_in
from .wide_weights import GraphNodes, narrow_candidates, outputs_and_gradients, raise_narrow_reads

_READ_IN_INFERENCE: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()  # per engine (see reads_only)


class FirstCall:
    """One block's checked first call: bind its weights to ``bound``, then call it inside the binding."""

    def __init__(self, engine: Any, block: int, args: tuple, kwargs: dict, weights: Sequence[torch.Tensor]) -> None:
        self.engine, self.block = engine, block
        self.module: nn.Module = engine.blocks[block]
        self.inference = torch.is_inference_mode_enabled()
        self.grad = torch.is_grad_enabled()
        # a graph like the recompute's: the weights as leaves, the inputs detached (their history is not ours).
        # Not for nested-tensor inputs: only a call without grad gets them (nn.TransformerEncoder's fast path,
        # in evaluation), and with grad the same modules refuse them; a training call brings dense ones.
        nested = any(isinstance(t, torch.Tensor) and t.is_nested for t in pytree.tree_leaves((args, kwargs)))
        self.narrow = bool(narrow_candidates(engine.stores[block], weights)) and not nested
        self.plain = args, kwargs  # under inference_mode (validate, test, predict): what the call itself gets, after
        # the narrow weights' reads are looked for, once per block, in a call with a graph outside it (reads_only)
        looked = _READ_IN_INFERENCE.setdefault(engine, set())
        self.reads_only = self.inference and self.narrow and block not in looked and not holds_a_cache(args, kwargs)
        self.graph = (not self.inference and not self.grad or self.reads_only) and not nested
        self.complete = not self.inference and not nested  # else a later call is checked again
        with torch.inference_mode(False):
            if self.reads_only:
                args, kwargs = pytree.tree_map_only(
                    torch.Tensor, lambda t: t.clone() if t.is_inference() else t.detach(), (args, kwargs))
            elif not self.inference and not self.grad:
                args, kwargs = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, (args, kwargs))
            self.probed: set[int] = set()  # frozen weights made leaves for the walk of wide_weights.py alone
            if self.graph:
                flags = engine.requires_grad_flags(block)
                # frozen weights narrower than their fp32: leaves too, so that the walk of wide_weights.py sees them
                probe = {i for i in narrow_candidates(engine.stores[block], weights) if not flags[i]}
                weights = [(w.clone() if w.is_inference() else w.detach()).requires_grad_(  # slots made in predict
                    (f or i in probe) and w.is_floating_point()) for i, (w, f) in enumerate(zip(weights, flags))]
                self.probed = {id(weights[i]) for i in probe}
        self.narrow = self.narrow and (not self.inference or self.reads_only)
        self.bound, self.args, self.kwargs = list(weights), args, kwargs
        # the containers it is handed, before the call and after it: each rerun starts from the first, leaves the second
        self.before: Snapshot = Snapshot(args, kwargs)
        self.after: Snapshot | None = None
        self.rebuilt: list[str] = []  # the plain containers it wrote into, in a step (see _refuse_lost)
        self.inputs = [t for t in pytree.tree_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor) and not t.is_inference()]
        self.versions = [t._version for t in self.inputs]
        # the model's parameters by name, read before the binding puts the block's weights in their places
        self.names = {} if self.inference else {id(p): n for n, p in engine.root.named_parameters(remove_duplicate=False)}

    def __call__(self, call: Callable[[tuple, dict], Any]) -> Any:
        if self.reads_only:
            self._reads_outside_inference(call)
        if self.inference:
            return call(*self.plain)
        names = self.names
        self._grad_hooks(names)
        attrs = dict(_tensor_attrs(self.module))
        passed = containers(self.args, self.kwargs)  # what the block may write into, and what they hold now
        held = {name: {id(t) for t in tensors_in(c)} for name, c in passed}
        hooked: list[tuple[str, weakref.ref]] = []
        handles = [m.register_forward_hook(_note_outputs(path, hooked))
                   for path, m in self.module.named_modules() if path and m._forward_hooks]
        # A graph built only to be walked keeps no saved tensors: each activation is freed as the no-graph
        # forward frees it, so the check adds no device memory (held until the call returned, one block's
        # activations at a time interleaved with the saved block inputs fragmented the allocator: peak
        # reserved grew with depth, 48 - 12 Llama blocks 1.547 GiB against the 1.125 of the inputs, H100).
        discard = torch.autograd.graph.saved_tensors_hooks(_dropped, _never_unpacked) if self.graph else nullcontext()
        rng = _rng_states(self.engine.streams.device) if self.graph or self.narrow else None
        recorded = side_outputs.lengths() if self.graph else None  # router logits the call records, with a graph
        nodes = self._watch()  # for the walk of wide_weights.py (its nodes held till its end)
        try:
            try:
                with torch.enable_grad(), discard, nodes:
                    out = call(self.args, self.kwargs)
            except RuntimeError as err:
                if not (self.graph and _differentiates_inside(err)):
                    raise
                # The block differentiates inside its own forward (torch.autograd.grad, torch.func), which
                # reads the saved tensors: the call again from its random state, keeping them (this block's
                # forward hooks and Python-side effects run twice in this first step).
                _restore_rng(rng)
                self.before.restore()
                hooked.clear()
                side_outputs.detach_since(recorded, drop=True)
                nodes = self._watch()
                with torch.enable_grad(), nodes:
                    out = call(self.args, self.kwargs)
        except RuntimeError as err:  # a kept block's inputs and weights are leaves that require grad
            if "leaf Variable that requires grad is being used in an in-place operation" in str(err):
                self._refuse_in_place()
            if "support saved tensor hooks" in str(err):
                self._refuse_func()
            raise
        finally:
            for h in handles:
                h.remove()
        if any(t._version != v for t, v in zip(self.inputs, self.versions)):
            self._refuse_in_place()
        self.after = Snapshot(self.args, self.kwargs)
        # in a step the block is handed pytree's rebuild of a plain container, not the caller's: refused after escapes
        self.rebuilt = [] if self.inference else [
            name for name, c in passed if type(c) in pytree.SUPPORTED_NODES and self.before.differs(c)]
        self._foreign(out, names)
        recomputed = _recomputed_weights(self.module)
        escaped = [self._qualified(path, name) for (path, name), t in _tensor_attrs(self.module)
                   if attrs.get((path, name)) is not t and self._trained(t) and (path, name) not in recomputed]
        escaped += [f"the {type(c).__name__} passed as its {name}" for name, c in passed
                    if any(self._trained(t) and id(t) not in held[name] for t in tensors_in(c))]
        if not self.graph:
            self._refuse_lost(escaped)
            if self.grad:
                self._narrow_reads(out, nodes, call, rng)
            return out if self.grad else pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out)
        side = side_outputs.detach_since(recorded)  # the Function returns them (side_outputs.py): not escaped
        self._narrow_reads((out, side), nodes, call, rng)
        out = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out)  # the graph goes with the last reference
        escaped += sorted({f"{self._qualified(path)}'s output (a forward hook)" for path, ref in hooked
                           if (t := ref()) is not None and self._trained(t) and not any(t is r for r in side)})
        self._refuse_lost(escaped)
        return out

    def _trained(self, t: torch.Tensor) -> bool:
        """Whether ``t`` has a gradient history the real call gives it too: one that reaches a leaf other than the
        frozen weights made leaves for the walk alone (``probed``)."""
        if t.grad_fn is None or not self.probed:
            return t.grad_fn is not None
        stack, seen = [t.grad_fn], set()
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            leaf = getattr(node, "variable", None)
            if leaf is not None and id(leaf) not in self.probed:
                return True
            stack.extend(n for n, _ in node.next_functions)
        return False

    def _narrow_reads(self, out: Any, nodes: Any, call: Callable[[tuple, dict], Any], rng: Any) -> None:
        """Raises ``NarrowRead`` (``wide_weights.raise_narrow_reads``), the forward run again if it may."""
        rerun = None if holds_a_cache(self.args, self.kwargs) else partial(self._rerun, call, rng)
        raise_narrow_reads(self.engine, self.block, self.bound, out, nodes, rerun)

    def _watch(self) -> Any:  # under a narrow compute dtype, what the graph cannot show (wide_weights.GraphNodes)
        return GraphNodes.over(self.engine.stores[self.block], self.bound) if self.narrow else nullcontext()

    def _reads_outside_inference(self, call: Callable[[tuple, dict], Any]) -> None:
        """Under inference_mode: the call with a graph outside it, for :meth:`_narrow_reads` alone (its outputs dropped,
        the random state restored for the call itself); not for a forward that cannot build one."""
        with torch.inference_mode(False):
            rng, recorded, nodes = _rng_states(self.engine.streams.device), side_outputs.lengths(), self._watch()
            try:
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_dropped, _never_unpacked), nodes:
                    out = call(self.args, self.kwargs)
                built = True
            except RuntimeError:
                built = False
            finally:
                side = side_outputs.detach_since(recorded, drop=True)
                _restore_rng(rng)
                self.before.restore()  # the call itself comes next
                self.after = self.before
            if built:  # a NarrowRead: looked for again in the rerun
                self._narrow_reads((out, side), nodes, call, rng)
        _READ_IN_INFERENCE[self.engine].add(self.block)

    def _rerun(self, call: Callable[[tuple, dict], Any], rng: Any, swaps: dict[int, torch.Tensor]) -> Any:
        """The forward and backward again from the first call's random state (then back to the state after it), the
        weights at ``swaps``' indices bound to its tensors: its output tensors and what it recorded (dropped from there),
        and the gradients (``wide_weights.outputs_and_gradients``)."""
        after, recorded, sites = (_rng_states(self.engine.streams.device), side_outputs.lengths(),
                                  self.engine.bindings[self.block].param_sites)
        held = [(m, name, m._parameters[name]) for i in swaps for m, name in sites[i]]
        try:
            for i, t in swaps.items():
                for m, name in sites[i]:
                    m._parameters[name] = t  # type: ignore[assignment]
            _restore_rng(rng)
            self.before.restore()
            out, grads = outputs_and_gradients(call, self.args, self.kwargs, [swaps.get(i, w) for i, w in enumerate(self.bound)])
            return out + side_outputs.detach_since(recorded, drop=True), grads
        finally:
            side_outputs.detach_since(recorded, drop=True)
            for m, name, t in held:
                m._parameters[name] = t
            _restore_rng(after)
            (self.after or self.before).restore()

    def _grad_hooks(self, names: dict[int, str]) -> None:
        ours = self.engine.outside.hook_ids()
        hooked = [names.get(id(p), "?") for p in self.engine.stores[self.block].params
                  if p._backward_hooks or set(getattr(p, "_post_accumulate_grad_hooks", None) or ()) - ours]
        if hooked:
            raise RuntimeError(
                f"{self._what()}: {', '.join(sorted(hooked)[:4])} has a gradient hook (register_hook or "
                "register_post_accumulate_grad_hook), and a streamed block's gradients reach the host accumulator "
                "without autograd on the parameter, so the hook would not run. Read or change the gradients in "
                "on_before_optimizer_step (each parameter's .grad holds the step's gradient there), hook the "
                f"module's output (register_full_backward_hook), {_FIX}")

    def _foreign(self, out: Any, names: dict[int, str]) -> None:
        """Refuses a model parameter the output's graph reaches beyond the inputs and the bound weights."""
        known = {id(t) for t in (*self.inputs, *self.bound)}
        stack = [t.grad_fn for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen: set[int] = set()
        foreign: set[str] = set()
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            leaf = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf that requires grad
            if leaf is not None and id(leaf) not in known and id(leaf) in names:
                foreign.add(names[id(leaf)])
            stack.extend(n for n, _ in node.next_functions)
        if foreign:
            raise RuntimeError(
                f"{self._what()}: its forward reads {', '.join(sorted(foreign)[:4])}, which it is not streamed "
                "with (a parameter reached through a plain attribute, not an argument or a submodule of the "
                "block): it would get no gradient from this block. Pass it to the block's forward as an argument "
                f"(a tensor argument gets its gradient), register the module that holds it under the block, {_FIX}")

    def _refuse_in_place(self) -> None:
        raise RuntimeError(
            f"{self._what()}: its forward changes one of its input tensors (or weights) in place, and a streamed "
            "block runs its forward again from its saved inputs in the backward's recompute. Compute out of place "
            f"(x = x * a, not x.mul_(a); x = x + y, not x += y), {_FIX}")

    def _refuse_func(self) -> None:
        raise RuntimeError(
            f"{self._what()}: its forward calls a torch.func transform (grad, vjp, jacrev, hessian), which refuses "
            "to run under saved-tensor hooks, and a streamed block's call runs under the engine's (they keep an "
            "activation checkpoint around the block from recording it). torch.autograd.grad inside the forward "
            f"(under torch.enable_grad(), with create_graph=torch.is_grad_enabled()) trains exactly, {_FIX}")

    def _refuse_lost(self, escaped: list[str]) -> None:
        """Refuses what the caller would not get: tensors with a gradient history kept beyond the outputs, then what
        the block wrote into a plain container it is handed (``self.rebuilt``)."""
        if escaped:
            self._refuse_escaped(escaped)
        if self.rebuilt:
            raise RuntimeError(
                f"{self._what()}: its forward writes into the {', '.join(self.rebuilt[:4])} (a plain dict or list), and "
                "in a step a streamed block is handed a rebuilt copy of it (its tensors travel through the strategy's "
                "autograd Function), so the caller would not see what the block puts there. Keep such state on a module "
                "(an attribute, replaced rather than appended to: the backward's recompute runs the forward again), or "
                f"pass a container of a class of your own (a subclass of dict or list is handed as it is), {_FIX}")

    def _refuse_escaped(self, where: list[str]) -> None:
        raise RuntimeError(
            f"{self._what()}: its forward keeps tensors with a gradient history beyond its outputs "
            f"({', '.join(where[:4])}), which have none under this strategy (the block runs "
            "without a graph and is recomputed in the backward): a loss built from them would not train the block. "
            "Return them from the block's forward (an auxiliary loss as an output, or added to the hidden states "
            "through a custom autograd Function), keep .detach()ed copies if they are only logged (replaced, "
            "not appended: the recompute runs the forward a second time in each step), "
            f"{_FIX}")

    def _qualified(self, path: str, attr: str = "") -> str:
        """``path`` (inside the block) and ``attr`` as the model names them: ``model.layers.0.mlp.aux_loss``."""
        root = next((n for n, m in self.engine.root.named_modules() if m is self.module), "")
        return ".".join(p for p in (root, path, attr) if p)

    def _what(self) -> str:
        return f"MegaTrainStrategy cannot train block {self.block} ({type(self.module).__name__}) exactly"


_INSIDE = "a block differentiated inside its own forward"


def _dropped(tensor: torch.Tensor) -> None:
    """Saved-tensor pack hook of the checked call's graph: saves nothing (the outer graph is never differentiated;
    a block that differentiates inside its forward is called again without it)."""
    return None


def _never_unpacked(_: None) -> torch.Tensor:
    raise RuntimeError(f"{_INSIDE} (a saved tensor of the first call's checked graph was read)")


def _differentiates_inside(err: RuntimeError) -> bool:
    """Whether ``err`` says the block's forward needed the saved tensors the check drops: our unpack hook, or
    torch.func refusing to run under saved-tensor hooks."""
    return _INSIDE in str(err) or "support saved tensor hooks" in str(err)


def _rng_states(device: torch.device) -> tuple[torch.device, torch.Tensor, torch.Tensor | None]:
    """The host generator's state and, on CUDA, the device's (host-side seed and offset: no device sync)."""
    return device, torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _restore_rng(states: tuple[torch.device, torch.Tensor, torch.Tensor | None] | None) -> None:
    if states is not None:
        device, host, cuda = states
        torch.set_rng_state(host)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


def _note_outputs(path: str, into: list[tuple[str, weakref.ref]]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        into.extend((path, weakref.ref(t)) for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor))
    return hook


def _recomputed_weights(module: nn.Module) -> set[tuple[str, str]]:
    """``(submodule path, attribute)`` of the weights torch's old ``weight_norm`` / ``spectral_norm`` set as plain
    attributes in a forward pre-hook: recomputed from the parameters before every forward, the recompute's too."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    return {(path, hook.name) for path, m in module.named_modules() for hook in m._forward_pre_hooks.values()
            if isinstance(hook, (WeightNorm, SpectralNorm))}


def _tensor_attrs(module: nn.Module) -> Iterator[tuple[tuple[str, str], torch.Tensor]]:
    """``((submodule path, attribute), tensor)`` for every plain tensor attribute of ``module`` and its
    submodules (in a list, tuple or dict one level deep too), parameters and buffers aside."""
    for path, m in module.named_modules():
        for name, value in vars(m).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                yield (path, name), value
            elif isinstance(value, (list, tuple)):
                for i, v in enumerate(value):
                    if isinstance(v, torch.Tensor):
                        yield (path, f"{name}[{i}]"), v
            elif isinstance(value, dict):
                for k, v in value.items():
                    if isinstance(v, torch.Tensor):
                        yield (path, f"{name}[{k!r}]"), v
