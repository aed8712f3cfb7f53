"""Which weights of a block must be fp32 on the device under a narrow compute dtype: those an op outside autocast's
matmuls reads.

Under bf16-mixed the engine computes a block from bf16 copies of its fp32 masters. Lightning's own bf16-mixed keeps
the weights fp32, and autocast casts them to bf16 only for the ops on its lower-precision list (matmuls,
convolutions, attention); every other op reads the fp32 weight: a layer scale of shape ``(1, dim)`` in a ``mul``,
Mamba's ``A_log`` in an ``exp``, T5's relative position bias in an ``embedding``, GPT-OSS's expert biases in an
``add``. A slot holds the one-dimensional weights in fp32 beside the bf16 ones (``layout.py``); a weight of more
dimensions that such an op reads (trainable, or frozen with an fp32 host copy) is found by its block's checked first
call (``first_call.py``) in the graph that call builds, and the call raises :class:`NarrowRead`. The caller
(``strategy.py``: a training, validation, test or predict step) has the engine keep those weights in fp32 in the
slots from then on (:func:`widen`, the same names in every block of the class) and runs the step again from its
random state: nothing of it had been updated.

The graph is walked from each such weight's leaf through the ops that only move or gather its values (views,
copies, ``cat``, indexing, ``embedding``; dtype casts too), up to the first op that computes with them, or the
block's outputs (which then carry the weight's values, fp32 under Lightning's). That op is a rounding
one (what autocast casts to bf16, or an op that needs its inputs in one dtype) whose output is in the compute
dtype: the weight was cast there under Lightning's bf16-mixed too, the same bits. Any other op of torch's reads
the weight's bf16 copy where Lightning's reads it in fp32. So does a library's ``autograd.Function`` (peft's LoHa,
C3A and RandLoRA compute their adapters' weights in one): it is handed the fp32 weight under Lightning's, and its
backward runs outside autocast, in that weight's dtype. Torch's own Functions and this package's (the chunked MLP
runs its matmuls inside one) are taken as rounding, and so are custom C++ ops. The walk starts from the block's
outputs and from every node the call made (:class:`GraphNodes`): a read whose result leaves the graph (DoRA's
weight norm, detached) is still a read.

Two kinds of reads leave no trace in the graph. A weight read through its ``.data`` or ``detach()`` (SHiRA adds its
update into its base weight's ``.data``), or under ``no_grad``: :class:`GraphNodes` follows those through the
functions that move values on, up to the first that computes with them. And a weight whose dtype, not its values,
changes what the block computes: peft's LoRA casts its input to ``lora_A``'s dtype (its dropout then runs in fp32
under Lightning's bf16-mixed, here in bf16; DoRA and MiSS cast so too), T5's feed-forward casts its hidden states to
its output weight's dtype (the gradients of that weight's LoRA and base paths then meet in fp32 under Lightning's,
here in bf16). :func:`dtype_reads` runs the block's forward and backward again with one weight at a time bound as an
fp32 copy of its bf16 values: the same values, so a matmul of it rounds to the same bits, and where an output's or a
gradient's bits change, the weight's dtype changed what the block computes. Once per
class of block, set of candidates and training mode (the step then runs again, as above); transformers' grouped
GEMM experts are left out: they compute in the weights' dtype, fp32 under Lightning's bf16-mixed
(``docs/internals.md``), and held so here they would run the experts' matmuls, most of an MoE's work, in fp32.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .compiled import WHOLE_IMPLEMENTATIONS, experts_of
from .placement import replace

# per engine, the (class of block, candidates, training) whose weights' dtypes were probed (dtype_reads)
_PROBED: weakref.WeakKeyDictionary[Any, set[tuple[type, tuple[int, ...], bool]]] = weakref.WeakKeyDictionary()

# Ops that round the weight to the compute dtype under Lightning's bf16-mixed: autocast's lower-precision list, and
# the ones that need their inputs in one dtype (an fp32 weight would have been cast by the model to run at all).
ROUNDING = frozenset({
    "MmBackward0", "AddmmBackward0", "BmmBackward0", "BaddbmmBackward0", "AddbmmBackward0", "MvBackward0",
    "AddmvBackward0", "DotBackward0", "VdotBackward0", "AddrBackward0", "ConvolutionBackward0",
    "ConvDepthwise2DBackward0", "ConvDepthwise3DBackward0", "SlowConv2DBackward0", "SlowConv3DBackward0",
    "CudnnConvolutionBackward0", "MkldnnConvolutionBackward0", "MkldnnLinearBackward0", "GroupedMmBackward0",
    "ScaledMmBackward0", "ScaledGroupedMmBackward0", "PreluKernelBackward0",
    "ScaledDotProductFlashAttentionBackward0", "ScaledDotProductEfficientAttentionBackward0",
    "ScaledDotProductCudnnAttentionBackward0", "ScaledDotProductFlashAttentionForCpuBackward0",
    "ScaledDotProductFusedAttentionOverrideableBackward0", "FlashAttentionBackward0",
    "EfficientAttentionBackward0", "CudnnAttentionBackward0",
})
# Ops that only move, gather or copy values: the walk goes on to what reads their output.
MOVING = frozenset({
    "TBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "TransposeBackward0",
    "TransposeBackward1", "PermuteBackward0", "ExpandBackward0", "SliceBackward0", "SelectBackward0",
    "SelectBackward1", "UnsqueezeBackward0", "UnsqueezeBackward1", "SqueezeBackward0", "SqueezeBackward1",
    "SqueezeBackward2", "SqueezeBackward3", "SqueezeBackward4", "AsStridedBackward0", "AliasBackward0",
    "SplitBackward0", "SplitBackward1", "SplitWithSizesBackward0", "UnsafeSplitBackward0",
    "UnsafeSplitWithSizesBackward0", "UnbindBackward0", "DiagonalBackward0", "UnfoldBackward0", "CloneBackward0",
    "CatBackward0", "StackBackward0", "IndexBackward0", "IndexSelectBackward0", "GatherBackward0",
    "RepeatBackward0", "FlipBackward0", "RollBackward0", "MaskedSelectBackward0", "TakeBackward0",
    "NarrowBackward0", "ToCopyBackward0", "LiftFreshBackward0", "ViewAsRealBackward0", "ViewAsComplexBackward0",
    "ValuesBackward0", "PixelShuffleBackward0", "PixelUnshuffleBackward0", "ChannelShuffleBackward0",
    "EmbeddingBackward0",
})


class NarrowRead(RuntimeError):
    """A block's first call found weights of two or more dimensions, computed in the narrow compute dtype, that an
    op outside autocast's matmuls reads, or whose dtype changes what the block computes. ``names``: their paths
    inside the block; ``ops``: what read them ("its dtype" for the latter)."""

    def __init__(self, block: int, module: str, names: Sequence[str], ops: Sequence[str]) -> None:
        self.block, self.names, self.ops = block, list(names), list(ops)
        read = ", ".join(f"{n} ({o})" for n, o in zip(names[:4], ops[:4]))
        super().__init__(
            f"MegaTrainStrategy: block {block} ({module}) reads {read} outside autocast's matmuls, where Lightning's "
            "bf16-mixed reads the fp32 weights. When a training, validation, test or predict step raises this, the "
            "strategy holds these weights in fp32 on the device and runs the step again; this forward ran outside "
            "them (in a callback or a hook, with grad or under no_grad): run it inside a step, or after the first "
            "training step.")


def narrow_candidates(store: Any, weights: Sequence[torch.Tensor]) -> list[int]:
    """Indices of ``weights`` (a block's, in its store's layout order) that the device holds in a narrow dtype where
    Lightning's bf16-mixed holds fp32: two or more dimensions, bf16/fp16, not yet wide, over fp32 host masters (a
    compact store's bf16 masters and frozen weights kept in their own narrow dtype read the same bits as there)."""
    if store.dtype != torch.float32:
        return []
    wide = set(store.layout.wide)
    return [i for i, (w, p) in enumerate(zip(weights, store.params)) if i not in wide and w.dim() >= 2
            and w.dtype in (torch.bfloat16, torch.float16) and p.dtype == torch.float32]


# What a read of a weight's ``.data`` (or ``detach()``, or the weight under ``no_grad``) may go through with no node of
# the graph (torch's functions and Tensor methods, by name): ops that move its values on, and those autocast rounds.
_MOVING_FUNCS = frozenset({
    "__get__", "clone", "contiguous", "view", "view_as", "reshape", "reshape_as", "t", "transpose", "permute",
    "__getitem__", "to", "detach", "float", "half", "bfloat16", "type", "type_as", "expand", "expand_as", "flatten",
    "unflatten", "unsqueeze", "squeeze", "split", "chunk", "narrow", "cat", "concat", "stack", "unbind", "flip",
    "roll", "repeat", "index_select", "gather", "movedim", "swapaxes", "ravel", "embedding",
})
_MATMUL_FUNCS = frozenset({
    "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv",
    "addr", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "einsum",
    "prelu", "scaled_dot_product_attention",
})


class GraphNodes(TorchFunctionMode):
    """Watches a call for :func:`narrow_reads`: holds the graph node of every tensor it makes (``nodes``), for the
    walk to reach the nodes no output reaches (a result detached, or unused: DoRA's weight norm); and follows the
    weights at ``watch`` (``{id: index}``) where the graph cannot: their ``.data`` and ``detach()`` and what moves
    those on, the weights themselves under ``no_grad``. An op other than those of ``_MOVING_FUNCS`` and the matmuls
    autocast rounds reads them: ``reads``, ``{index: op}`` (SHiRA adds its sparse update into a clone of its base
    weight's ``.data``). A node without its saved tensors costs a few hundred bytes (the checked first call drops
    them: ``first_call.py``)."""

    def __init__(self, watch: dict[int, int]) -> None:
        super().__init__()
        self.nodes: list[Any] = []
        self.watch, self.aliases = watch, {}  # aliases: {id: (index, tensor)}, held so that the ids stay theirs
        self.reads: dict[int, str] = {}

    @classmethod
    def over(cls, store: Any, bound: Sequence[torch.Tensor]) -> "GraphNodes":
        """Watching a block's narrow candidates (``bound``: the weights its call is bound to; ``store``: its store)."""
        return cls({id(bound[i]): i for i in narrow_candidates(store, bound)})

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        made = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.nodes += [t.grad_fn for t in made if t.grad_fn is not None]
        name = getattr(func, "__name__", "")
        if args and id(args[0]) in self.watch and (name == "detach" or func == torch.Tensor.data.__get__):
            self.aliases.update((id(t), (self.watch[id(args[0])], t)) for t in made)
            return out
        grad = torch.is_grad_enabled()
        hit = [self.aliases[id(t)][0] if id(t) in self.aliases else self.watch[id(t)]
               for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
               and (id(t) in self.aliases or (not grad and id(t) in self.watch))]
        if not hit or not made:  # not a read of theirs, or one of metadata (a shape, a dtype)
            return out
        if name in _MOVING_FUNCS:
            self.aliases.update((id(t), (hit[0], t)) for t in made)
        elif name not in _MATMUL_FUNCS or any(t.dtype == torch.float32 for t in made):
            for i in hit:
                self.reads.setdefault(i, name)
        return out


def raise_narrow_reads(engine: Any, block: int, bound: Sequence[torch.Tensor], out: Any, nodes: Any,
                       rerun: Callable[[dict[int, torch.Tensor]], list[torch.Tensor]] | None) -> None:
    """Raises :class:`NarrowRead` for the weights of block ``block`` (``bound``: those its first call was bound to),
    bf16 here and fp32 under Lightning's bf16-mixed, that an op outside autocast's matmuls reads (in the graph of
    ``out``, or as ``nodes``, a :class:`GraphNodes`, saw) or whose dtype changes what the block computes (through
    ``rerun``, see :func:`dtype_reads`; None: not probed): trainable ones, and frozen ones with fp32 host copies."""
    module = engine.blocks[block]
    candidates = narrow_candidates(engine.stores[block], bound)
    if not candidates:
        return
    found = {**getattr(nodes, "reads", {}), **narrow_reads(out, bound, candidates, getattr(nodes, "nodes", ()))}
    probed = _PROBED.setdefault(engine, set())
    key = (type(module), tuple(candidates), module.training)  # a dropout runs in training alone
    if not found and rerun is not None and key not in probed:
        probed.add(key)
        grouped = {id(m) for m in experts_of(module)
                   if getattr(getattr(m, "config", None), "_experts_implementation", None) in WHOLE_IMPLEMENTATIONS}
        sites = engine.bindings[block].param_sites
        try:
            found = dtype_reads(rerun, bound, [i for i in candidates if not any(id(m) in grouped for m, _ in sites[i])])
        except Exception:  # a forward that cannot run without a graph (one differentiating inside): unprobed
            found = {}
    if found:
        paths = {id(t): n for n, t in module.named_parameters(remove_duplicate=False)}
        raise NarrowRead(block, type(module).__name__, [paths.get(id(bound[i]), f"parameter {i}") for i in found],
                         list(found.values()))


def narrow_reads(out: Any, weights: Sequence[torch.Tensor], candidates: Sequence[int],
                 nodes: Sequence[Any] = ()) -> dict[int, str]:
    """``{index into weights: name of the op}`` for each candidate weight (a leaf of the graph of ``out`` or of
    ``nodes``, in a dtype narrower than fp32) that an op other than a rounding one reads (see the module's
    docstring)."""
    leaves = {id(weights[i]): i for i in candidates if weights[i].requires_grad}
    if not leaves:
        return {}
    parents: dict[int, list[Any]] = {}  # node -> the nodes that read its output
    accumulators: dict[int, Any] = {}
    stack = [t.grad_fn for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    roots = {id(node) for node in stack}  # what leaves the block: fp32 under Lightning's if a weight's values are
    stack += nodes
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(id(child), []).append(node)
            leaf = getattr(child, "variable", None)
            if leaf is not None and id(leaf) in leaves:
                accumulators[leaves[id(leaf)]] = child
            stack.append(child)
    found: dict[int, str] = {}
    for i, acc in accumulators.items():
        narrow = weights[i].dtype
        todo, visited = list(parents.get(id(acc), ())), set()
        while todo:
            node = todo.pop()
            if id(node) in visited:
                continue
            visited.add(id(node))
            name = node.name()
            if name in MOVING:
                if id(node) in roots:  # its values leave the block as they are (the next block reads them)
                    found[i] = name
                    break
                todo.extend(parents.get(id(node), ()))
            elif name in ROUNDING:
                if _output_dtype(node, narrow) != narrow:  # a matmul in fp32 (autocast off) of the widened copy
                    found[i] = name
                    break
            elif name[-1:].isdigit() and name.rstrip("0123456789").endswith("Backward"):  # one of torch's ops
                found[i] = name
                break
            elif _foreign_function(node):  # a library's autograd.Function: see the module's docstring
                found[i] = name
                break
    return found


Run = Callable[[dict[int, torch.Tensor]], tuple[list[torch.Tensor], list[torch.Tensor]]]


def dtype_reads(run: Run, weights: Sequence[torch.Tensor], candidates: Sequence[int]) -> dict[int, str]:
    """``{index into weights: "its dtype"}`` for each candidate whose dtype, not its values, changes what the block
    computes (see the module's docstring). ``run(swaps)``: the block's forward from the same random state, the
    weights at ``swaps``' indices bound to its tensors; returns its outputs (and what the call recorded) and the fp32
    gradients of its inputs and weights for fixed cotangents (:func:`outputs_and_gradients`). A weight of zeros
    (LoRA's ``lora_B`` before its first update) would hide what the ops before it did: the runs bind random values
    there (bf16, in every run the same). A forward whose outputs differ between two runs of the same weights tells
    nothing: ``{}``; a backward whose gradients do (atomics: CUDA's ``index_add_``, some attention backwards) leaves
    the outputs alone to tell."""
    if not candidates:
        return {}
    zeros = [i for i in candidates if not weights[i].any()]
    generator = torch.Generator(weights[candidates[0]].device).manual_seed(0)
    base = {i: (torch.randn(weights[i].shape, generator=generator, device=weights[i].device)
                / max(weights[i].shape[-1], 1) ** 0.5).to(weights[i].dtype).requires_grad_(weights[i].requires_grad)
            for i in zeros}
    reference, grads = run(base)
    again, grads_again = run(base)
    if not _same_bits(reference, again):
        return {}
    backward = _same_bits(grads, grads_again)
    found = {}
    for i in candidates:
        wide = base.get(i, weights[i]).detach().float().requires_grad_(weights[i].requires_grad)
        out, g = run({**base, i: wide})
        if not _same_bits(reference, out) or (backward and not _same_bits(grads, g)):
            found[i] = "its dtype"
    return found


def outputs_and_gradients(call: Callable[[tuple, dict], Any], args: tuple, kwargs: dict,
                          weights: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One run of :func:`dtype_reads`: ``call`` on leaves made of the floating tensors of ``args`` and ``kwargs``; its
    output tensors, and the fp32 gradients of those leaves and of the ``weights`` that require grad for cotangents
    drawn from a fixed seed (the same in every run); none where the forward cannot be differentiated. The graph lives
    for this call alone (one block's activations)."""
    args, kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: t.detach().requires_grad_(t.is_floating_point()), (args, kwargs))
    with torch.enable_grad():
        out = call(args, kwargs)
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    differentiable = [t for t in outs if t.requires_grad]
    targets = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    targets += [w for w in weights if w.requires_grad]
    grads: list[torch.Tensor] = []
    if differentiable and targets:
        generator = torch.Generator(differentiable[0].device).manual_seed(1)
        cotangents = [torch.randn(t.shape, generator=generator, device=t.device).to(t.dtype) for t in differentiable]
        try:
            grads = [g.float() for g in torch.autograd.grad(differentiable, targets, cotangents, allow_unused=True)
                     if g is not None]
        except RuntimeError:  # a forward that differentiates inside, say: its outputs alone tell
            grads = []
    return [t.detach() for t in outs], grads


def _same_bits(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether two lists of tensors hold the same dtypes, shapes and bits (NaNs included)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.is_floating_point() or x.is_complex():
            x, y = (t.detach().reshape(-1).contiguous().view(torch.uint8) for t in (x, y))
        if not torch.equal(x, y):
            return False
    return True


def _foreign_function(node: Any) -> bool:
    """Whether ``node`` is the backward of an ``autograd.Function`` of neither torch nor this package: it receives
    the fp32 weight under Lightning's bf16-mixed, and its backward runs outside autocast, in the weight's dtype."""
    cls = getattr(node, "_forward_cls", None)
    module = getattr(cls, "__module__", None) or ""
    return cls is not None and not module.startswith(("torch.", "megatrain_lightning."))


def _output_dtype(node: Any, default: torch.dtype) -> torch.dtype:
    """The dtype of the forward output of ``node`` (its backward's incoming gradient)."""
    meta = getattr(node, "_input_metadata", None)
    try:
        return meta[0].dtype if meta else default
    except (AttributeError, IndexError, TypeError):
        return default


def widen(engine: Any, read: NarrowRead) -> list[tuple[str, int]]:
    """Between steps (after ``engine.abort_step``): the weights ``read`` names, in its block and in every block of the
    same class that has them, held in fp32 in the device slots from now on; the slots are laid out again, the host
    state untouched (``placement.replace``). Returns their paths in the model and sizes."""
    module = engine.blocks[read.block]
    paths = {id(m): n for n, m in engine.root.named_modules()}
    widened: list[tuple[str, int]] = []
    for j, (block, store) in enumerate(zip(engine.blocks, engine.stores)):
        if type(block) is not type(module):
            continue
        index = {id(p): k for k, p in enumerate(store.layout.params)}
        params = dict(block.named_parameters(remove_duplicate=False))
        at = {n: index[id(params[n])] for n in read.names if n in params and id(params[n]) in index}
        new = set(store.layout.widen(list(at.values())))
        if j == read.block and not new:
            raise RuntimeError(f"{read} (found no weights of the block to widen: a bug, please report it)") from read
        widened += [(f"{paths.get(id(block), '?')}.{n}", params[n].numel()) for n, k in at.items() if k in new]
    with torch.inference_mode(False):  # from a validation or predict step: slots made there would be inference tensors
        replace(engine, engine.config)
    return widened
