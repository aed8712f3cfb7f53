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
runs its matmuls inside one) are taken as rounding, and so are custom C++ ops.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

from .placement import replace

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
    op outside autocast's matmuls reads. ``names``: their paths inside the block; ``ops``: what read them."""

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


def narrow_reads(out: Any, weights: Sequence[torch.Tensor], candidates: Sequence[int]) -> dict[int, str]:
    """``{index into weights: name of the op}`` for each candidate weight (a leaf of ``out``'s graph, in a dtype
    narrower than fp32) that an op other than a rounding one reads (see the module's docstring)."""
    leaves = {id(weights[i]): i for i in candidates if weights[i].requires_grad}
    if not leaves:
        return {}
    parents: dict[int, list[Any]] = {}  # node -> the nodes that read its output
    accumulators: dict[int, Any] = {}
    stack = [t.grad_fn for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    roots = {id(node) for node in stack}  # what leaves the block: fp32 under Lightning's if a weight's values are
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
    replace(engine, engine.config)
    return widened
