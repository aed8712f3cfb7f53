"""Blocks run through ``torch.compile``: the block's own forward, its elementwise work fused by inductor.

A streamed step's device time beside the matmuls is mostly elementwise: the norms, rotary embedding, SwiGLU,
casts and residual adds of each block, several kernels each under eager autocast, run again in a kept block's
selective recompute. Inductor fuses them: one Qwen2.5-7B layer, forward + backward at 32 K tokens on the H200,
92.4 -> 77.2 ms with every activation kept and 104.1 -> 78.3 ms saving matmul outputs only (2026-12-04,
``recipes/fused_kernels.py``); a 3B layer 21.9 -> 14.0 ms. Not bit for bit: fused kernels round differently
(bf16: 4e-4 relative on a layer's output, the size of any kernel change).

What is compiled is the function the block's class defines, once per class (every block of a class shares
the compiled code: its parameters are inputs of the graph, which the engine binds to slot tensors), called
with the block's weights already bound (``block_call.run_bound``). A kept block that saves matmul outputs
only (``selective.py``) is compiled with its selective checkpoint inside, so that the partitioner, not a
replay in Python, recomputes the elementwise ops in the backward. Eager instead: a block's first call (it is
the one checked for buffer updates) and a function whose compilation failed (one warning; the run goes on eager,
exactly as before). Blocks compile while router logits are recorded: dynamo breaks the graph at the recording
hook (its ``ContextVar.get``), which runs eager, appending the router's output, a tensor of the graph before the
break, and the rest of the block compiles from there (``side_outputs`` takes what was appended, with grad in the
recompute, as it does eager): Qwen3-30B-A3B cut to 10 layers with its router loss on an H100, 272.9 model TFLOPS
against 207.0 eager (2026-12-06). A call that must compile whole (a kept block saving matmul outputs, its
checkpoint inside) has no place to break: there the hook reads transformers' collector as a plain attribute and
appends inside the graph (``side_outputs.in_one_graph``); where it cannot (``output_hidden_states``, a collector
already compiling) the call runs eager. Random ops (dropout) draw from torch's
generator as eager ones do (inductor's ``fallback_random``): the masks are the eager module's, and a recompute
replays its forward's.

Experts: grouped GEMM experts without biases (``experts_implementation`` ``grouped_mm`` or ``grouped_mm_gather``:
Qwen3-MoE's, Mixtral's...) compile inside their block's graph, their sorting gathers, casts and weighting fused
with the rest (:func:`inside_graphs`). Other Hugging Face experts (``*Experts`` modules: GPT-OSS's, with biases; any
on transformers' eager loop) are compiled around: their forward runs eager through ``torch.compiler.disable`` (a
graph break on each side; compiled, GPT-OSS-20B's blocks stopped on the H200 with ``_grouped_mm``'s device-side
assert, torch 2.11, 2026-12-04), the attention, norms, router and residual adds fused. Such a block cannot hold
its selective checkpoint inside one graph, so a kept one saving matmul outputs runs compiled without it
(inductor's partitioner chooses what the fused parts save) and its experts under their own selective checkpoint
(:func:`~.selective.saving_matmuls`, their weights passed in, so the recompute reads the tensors the forward
read). Left open (``compile_blocks=None``), blocks with Hugging Face's experts compile too: on the H200
(2026-12-05, torch 2.11, 7 layers at 14 x 2048) GPT-OSS-20B's step 1.209 -> 1.058 s around its experts (224.9 ->
256.9 model TFLOPS); on the H100 (5 layers at 8 x 2048, side by side) Qwen3-30B-A3B's around its experts 169.7,
whole 190.3 model TFLOPS. A block routing to experts some other way (a router with ``num_experts`` and no
``*Experts`` module: its per-expert loop is data-dependent, unmeasured) stays eager unless ``compile_blocks=True``.
"""

from __future__ import annotations

import contextlib
import logging
from contextvars import ContextVar
from functools import partial
from typing import Any, Callable

import torch

from . import side_outputs
from ..attached import method_of
from .selective import saving_matmuls

log = logging.getLogger(__name__)

# What a compiled kept block saving matmul outputs holds over one keeping every activation (the first step
# measures the latter: its recompute runs compiled). Inductor already keeps fewer of the elementwise outputs, so
# the saving is smaller than eager's (~0.46 at 7B): 3.48 / 5.07 GiB for a Qwen2.5-7B layer at 32 K tokens, 1.00 /
# 1.47 for a 3B layer at 16 K (H200, 2026-12-04, recipes/fused_kernels.py).
COMPILED_MATMULS_RATIO = 0.69


def compiles_by_default(device: torch.device, compute_dtype: torch.dtype) -> bool:
    """``compile_blocks=None``: on a CUDA device under mixed precision, where kernels already round the
    compute (fp32 runs stay eager: bit for bit with Lightning's default strategy); blocks routing to experts
    without a Hugging Face ``*Experts`` module stay eager (:class:`CompiledBlocks`)."""
    return device.type == "cuda" and compute_dtype in (torch.bfloat16, torch.float16)


def experts_of(block: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``block`` that route tokens to experts and run them: Hugging Face's ``*Experts`` (every MoE
    of transformers 5: ``MixtralExperts``, ``GptOssExperts``, ``Qwen3MoeExperts``...)."""
    return [m for m in block.modules() if type(m).__name__.endswith("Experts")]


# The experts implementations compiled inside their block's graph: sorting, grouped GEMMs and gathers with no
# data-dependent Python (transformers' eager experts loop over the experts a batch hit: a graph break each).
WHOLE_IMPLEMENTATIONS = ("grouped_mm", "grouped_mm_gather")


def inside_graphs(experts: torch.nn.Module) -> bool:
    """Whether ``experts`` compile inside their block's graph (inductor fuses the routing's gathers, casts and
    weighting with the rest) rather than run eager between two graphs: grouped GEMM experts without biases.
    Qwen3-30B-A3B's 5 layers on the H100 (2026-12-05, 8 x 2048, side by side): 169.7 -> 190.3 model TFLOPS. Experts
    with biases (GPT-OSS) stay outside: compiled whole, GPT-OSS-20B stopped on ``_grouped_mm``'s device-side
    assert (H200, 7 layers, 14 x 2048, 2026-12-04); one clean 4-layer run since (H100) does not lift that."""
    config = getattr(experts, "config", None)
    return (getattr(config, "_experts_implementation", None) in WHOLE_IMPLEMENTATIONS
            and not getattr(experts, "has_bias", False))


def has_experts(block: torch.nn.Module) -> bool:
    """Whether ``block`` routes tokens to experts (a Hugging Face ``*Experts`` module, or a router with
    ``num_experts``)."""
    return bool(experts_of(block)) or any(hasattr(m, "num_experts") for m in block.modules())


# True while a compiled kept block saving matmul outputs runs: its experts run under their own selective checkpoint
_experts_save_matmuls: ContextVar[bool] = ContextVar("megatrain_experts_save_matmuls", default=False)


class CompiledBlocks:
    """The compiled forwards of one engine's blocks. ``checked``: the engine's set of blocks whose first
    (eager, checked) call has run. ``auto``: ``compile_blocks=None`` (blocks routing to experts without a Hugging Face
    ``*Experts`` module stay eager; those with one compile around it)."""

    def __init__(self, enabled: bool, checked: set[int], blocks: list[torch.nn.Module], auto: bool = False) -> None:
        self.enabled = enabled
        self.checked = checked
        self.eager = {i for i, b in enumerate(blocks) if auto and has_experts(b) and not experts_of(b)}
        # blocks compiled around their experts, and each experts module's own forward (restored by close())
        self.around_experts = {i for i, b in enumerate(blocks) if enabled and i not in self.eager
                               and not all(inside_graphs(e) for e in experts_of(b))}
        self._experts: list[tuple[torch.nn.Module, Any]] = []  # (module, the forward it held on the instance)
        for i in sorted(self.around_experts):
            for experts in experts_of(blocks[i]):
                self._experts.append((experts, experts.__dict__.get("forward")))
                experts.forward = method_of(experts, "forward", _outside_graphs(experts, experts.forward))  # type: ignore
        # by (class function, matmuls_only, around experts): one class can hold blocks of both kinds (Qwen3-MoE's
        # dense mlp_only_layers), whose kept blocks compile differently
        self._compiled: dict[tuple[Callable[..., Any], bool, bool], Callable[..., Any]] = {}
        self._failed: set[tuple[Callable[..., Any], bool, bool]] = set()

    @property
    def whole(self) -> bool:
        """Whether every block compiles whole (a kept one's selective checkpoint inside its graph)."""
        return self.enabled and not self.eager and not self.around_experts

    def runs(self, block: int, original: Callable[..., Any], matmuls_only: bool = False) -> bool:
        """Whether block ``block``'s next call (its class function ``original``; ``matmuls_only``: saving matmul
        outputs only) runs compiled."""
        return (self.enabled and block in self.checked and block not in self.eager
                and (original, matmuls_only, block in self.around_experts) not in self._failed
                and not (self._fullgraph(block, matmuls_only) and side_outputs.recording()
                         and not side_outputs.traceable()))  # no place to break at the recording hook

    def _fullgraph(self, block: int, matmuls_only: bool) -> bool:
        """Whether block ``block``'s call compiles as one graph: a kept block saving matmul outputs, its selective
        checkpoint inside (not around experts, whose own checkpoint runs eager between two graphs)."""
        return matmuls_only and block not in self.around_experts

    def call(self, block: int, original: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict,
             matmuls_only: bool = False) -> Any:
        """``original(module, *args, **kwargs)`` (block ``block``) compiled (with ``matmuls_only``: saving only
        matmul and attention outputs for the backward). Falls back to eager if compiling fails; a fallback
        under ``matmuls_only`` runs without selective saving (this call's graph keeps every activation; later
        calls take the eager selective path, ``runs(..., matmuls_only=True)`` being False)."""
        around_experts = block in self.around_experts
        key = (original, matmuls_only, around_experts)
        fn = self._compiled.get(key)
        if fn is None:
            # fullgraph: a graph break inside the checkpoint would run it eager, and its recompute would then
            # run in the backward, after the block's weights were unbound; compiling whole or not at all. Around
            # experts (a graph break each side) the checkpoint is theirs alone (_outside_graphs).
            fn = self._compiled[key] = (torch.compile(partial(saving_matmuls, original), fullgraph=True)
                                        if self._fullgraph(block, matmuls_only) else torch.compile(original))
        saving = _experts_save_matmuls.set(matmuls_only and around_experts)
        recorder = (side_outputs.in_one_graph() if self._fullgraph(block, matmuls_only) and side_outputs.recording()
                    else contextlib.nullcontext())
        try:
            with _dynamo_settings(), _eager_random(), recorder:
                return fn(module, *args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:
            self._failed.add(key)
            log.warning("torch.compile failed on %s%s (%s: %s); eager from here on",
                        getattr(original, "__qualname__", original), " saving matmul outputs" if matmuls_only else "",
                        type(err).__name__, (str(err).splitlines() or [""])[0][:300])
            return original(module, *args, **kwargs)
        finally:
            _experts_save_matmuls.reset(saving)

    def close(self) -> None:
        """Give the experts modules their own forward back."""
        for experts, held in self._experts:
            if held is None:
                experts.__dict__.pop("forward", None)
            else:
                experts.forward = held
        self._experts = []


def _outside_graphs(experts: torch.nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``experts``' forward, run eager where a compiled block calls it; in a kept block saving matmul outputs
    under its own selective checkpoint, the experts' parameters (the weights the engine bound) among its
    inputs: the recompute in the backward, after the block's weights were unbound, binds them again."""

    @torch.compiler.disable
    def run(*args: Any, **kwargs: Any) -> Any:
        if not (_experts_save_matmuls.get() and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        sites = [(m, name) for m in experts.modules() for name, t in m._parameters.items() if t is not None]

        def bound(*tensors: Any) -> Any:
            held = [m._parameters[name] for m, name in sites]
            for (m, name), t in zip(sites, tensors[len(args):]):
                m._parameters[name] = t
            try:
                return forward(*tensors[:len(args)], **kwargs)
            finally:
                for (m, name), t in zip(sites, held):
                    m._parameters[name] = t

        return saving_matmuls(bound, *args, *[m._parameters[name] for m, name in sites])

    return run


def _eager_random() -> Any:
    # Random ops (dropout) draw from torch's generator as eager ops do, not from inductor's own Philox streams:
    # the masks are then those of the eager module under Lightning's default strategy, and a streamed block's
    # recompute (another compiled graph than its forward's) replays its forward's masks from the restored RNG
    # state (block.RecomputeState), as in eager.
    import torch._inductor.config as inductor_config

    return inductor_config.patch(fallback_random=True)


def _dynamo_settings() -> Any:
    """What dynamo is told around a compiled block call (one patch of its config: each costs ~12 us a call)."""
    settings = {
        # A compiled block runs its submodules' hooks as eager calls would: dynamo guards on them and recompiles
        # when one is added or removed. By default it does not ("unsafe" in torch's words) and would run the graph
        # first compiled: transformers installs its recording hooks lazily, at the first call that records router
        # logits, so blocks compiled in a run without them recorded nothing in a later one of the process (a
        # streamed block's recompute then refused; a kept block's logits missing from the loss, silently where
        # other layers recorded), and a hook a callback registers mid-run was skipped. Guarding costs no
        # recompilation across layers whose hooks are alike (tests/test_compiled_experts.py, the router loss
        # compiled whole), ~4 us a call.
        "skip_nnmodule_hook_guards": False,
        # transformers' decoder layers (5.25, on the CPU) set a context variable in their forward, which dynamo
        # refuses inside a checkpointed region ("HOP: Unsafe side effect") unless told that the recompute need not
        # replay it; the recompute records nothing anyway (block.py silences it under eager selective saving too).
        "skip_fwd_side_effects_in_bwd_under_checkpoint": True,
    }
    config = torch._dynamo.config
    return config.patch(**{k: v for k, v in settings.items() if hasattr(config, k)})
