"""Finding the repeated blocks of a model: what gets streamed, and what stays resident.

Rules, in order:

1. ``block_class`` given (a class, a class name, or several): every outermost submodule of that class.
2. Hugging Face models: the classes named in ``_no_split_modules`` (their decoder layers), less a class
   with one instance whose weights the rest of the model shares (BERT's embeddings, tied to its MLM
   decoder): that one stays resident.
3. Otherwise: every outermost ``nn.ModuleList`` / ``nn.Sequential`` whose children are two or more
   modules of one class with parameters (``model.layers``, ``TransformerEncoder.layers``, both lists of
   ``nn.Transformer``, a user's own block list).

Whatever is found must be safe to stream: no block may share a parameter with another block or with
the resident part, and a list mixing block classes is refused rather than guessed at.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn


class BlockDetectionError(ValueError):
    """The model's blocks could not be found or cannot be streamed; the message says what to pass."""


def _class_matches(module: nn.Module, wanted: Sequence[type | str]) -> bool:
    for w in wanted:
        if isinstance(w, str):
            if type(module).__name__ == w or f"{type(module).__module__}.{type(module).__name__}" == w:
                return True
        elif isinstance(module, w):
            return True
    return False


def _outermost(root: nn.Module, wanted: Sequence[type | str]) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if _class_matches(child, wanted):
                found.append((path, child))
            else:
                visit(path, child)

    visit("", root)
    return found


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _repeated_lists(root: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """Outermost homogeneous block lists, and the paths of lists that mix block classes."""
    blocks: list[tuple[str, nn.Module]] = []
    mixed: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                # _modules, not named_children(): the same block object listed twice must be seen twice
                members = [(f"{path}.{n}", c) for n, c in child._modules.items() if c is not None and _has_params(c)]
                classes = {type(c) for _, c in members}
                # a list of lists (stages of layers, Funnel's encoder.blocks) has no forward to stream: look inside
                if len(members) >= 2 and len(classes) == 1 and not issubclass(next(iter(classes)), (nn.ModuleList, nn.ModuleDict)):
                    blocks.extend(members)
                    continue
                if len(members) >= 2 and len(classes) > 1 and all(len(list(c.children())) > 0 for _, c in members):
                    mixed.append(f"{path} ({', '.join(sorted(c.__name__ for c in classes))})")
            visit(path, child)

    visit("", root)
    return blocks, mixed


def find_blocks(root: nn.Module, block_class: type | str | Sequence[type | str] | None = None) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every block to stream, in registration order.

    Raises:
        BlockDetectionError: nothing to stream, a mixed block list, or blocks that share parameters.
    """
    if block_class is not None:
        wanted = [block_class] if isinstance(block_class, (str, type)) else list(block_class)
        blocks = _outermost(root, wanted)
        if not blocks:
            names = sorted({type(m).__name__ for m in root.modules()})
            raise BlockDetectionError(
                f"block_class={block_class!r} matches no submodule of {type(root).__name__}. "
                f"Module classes present: {', '.join(names)}."
            )
    else:
        blocks = []
        for m in root.modules():
            names = getattr(m, "_no_split_modules", None)
            if names and hasattr(m, "config"):
                blocks = _untied_singletons(root, _outermost(root, list(names)))
                break
        if not blocks:
            blocks, mixed = _repeated_lists(root)
            if not blocks:
                hint = (
                    f" Block lists mixing classes were found: {'; '.join(mixed)}; name the ones to stream with "
                    "MegaTrainStrategy(block_class=...)."
                    if mixed
                    else ""
                )
                raise BlockDetectionError(
                    f"MegaTrainStrategy found no repeated blocks in {type(root).__name__}: it streams the "
                    "layers of a ModuleList of same-class blocks (such as `model.layers`), one at a time."
                    f"{hint} If the model has such layers under another structure, pass "
                    f"MegaTrainStrategy(block_class=...){_suggest(root) or _NOTHING_TO_STREAM}."
                )
    _check_no_sharing(root, blocks)
    _check_not_compiled(blocks)
    return blocks


def _check_not_compiled(blocks: Sequence[tuple[str, nn.Module]]) -> None:
    """Blocks wrapped by ``torch.compile(block)`` (an ``OptimizedModule``, whose class has no forward of its own to
    run on streamed weights): refused, naming the class they wrap, which block_class can stream instead."""
    compiled = [(n, m) for n, m in blocks if hasattr(m, "_orig_mod") and type(m).__name__ == "OptimizedModule"]
    if compiled:
        name, first = compiled[0]
        inner = type(first._orig_mod).__name__
        raise BlockDetectionError(
            f"the blocks to stream ({name}, ...) are torch.compile'd modules (OptimizedModule around {inner}): "
            f"the strategy binds each block's streamed weights and runs the block's own forward. Stream the modules "
            f"they wrap, MegaTrainStrategy(block_class=\"{inner}\"), or keep the blocks uncompiled: "
            "EngineConfig(compile_blocks=True) compiles them around the streamed weights.")


def _check_no_sharing(root: nn.Module, blocks: Sequence[tuple[str, nn.Module]]) -> None:
    owner: dict[int, str] = {}
    seen_modules: dict[int, str] = {}
    for name, block in blocks:
        if id(block) in seen_modules:
            raise BlockDetectionError(
                f"the same block object appears as {seen_modules[id(block)]} and {name}: a block reused "
                "at several depths shares its weights, which MegaTrainStrategy cannot stream. Give each "
                "depth its own module (or pass block_class to stream a different level)."
            )
        seen_modules[id(block)] = name
        for pname, p in block.named_parameters():
            if id(p) in owner and owner[id(p)] != name:
                peft = _peft_layer_of(block, pname)
                fix = (f" ({peft} is a peft adapter layer: this method shares its weights across layers, as VB-LoRA's "
                       "vector bank and TinyLoRA's shared vectors do; train it with Lightning's default strategy, or "
                       "with a peft method whose weights are per layer, such as LoRA)" if peft else "")
                raise BlockDetectionError(
                    f"blocks {owner[id(p)]} and {name} share the parameter {pname}{fix}: shared weights cannot be "
                    f"streamed per block. Untie them, or pass block_class to stream a level without sharing"
                    f"{_suggest(root)}."
                )
            owner[id(p)] = name
    for pname, p in root.named_parameters(remove_duplicate=False):
        if id(p) in owner and not pname.startswith(owner[id(p)] + "."):
            raise BlockDetectionError(
                f"{pname} is the same parameter as one inside block {owner[id(p)]}: a weight shared between "
                f"a streamed block and the rest of the model cannot be streamed. Untie it, or pass "
                f"block_class{_suggest(root)}."
            )


def _peft_layer_of(block: nn.Module, pname: str) -> str | None:
    """The peft tuner layer (``peft.tuners.*``) on the way to parameter ``pname`` of ``block``, named with its
    class; None if there is none."""
    path = pname.split(".")
    module: nn.Module | None = block
    for i, part in enumerate(path[:-1]):
        module = getattr(module, part, None)
        if module is None:
            return None
        where = type(module).__module__
        if where.startswith("peft.tuners."):
            return f"{'.'.join(path[:i + 1])} ({where.removesuffix('.layer')}.{type(module).__name__})"
    return None


_NOTHING_TO_STREAM = ("; a model without repeated blocks has nothing to stream (its whole state is what a "
                      "streamed block would hold): train it with Lightning's default strategy")


def _shares_outside(root: nn.Module, path: str, module: nn.Module) -> bool:
    """Whether a parameter of ``module`` (at ``path``) is also reached from outside it."""
    own = {id(p) for p in module.parameters()}
    return any(id(p) in own and not name.startswith(path + ".")
               for name, p in root.named_parameters(remove_duplicate=False))


def _untied_singletons(root: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``blocks`` less each one that is its class's only instance and shares weights with the rest of the
    model (an embedding tied to an output layer): resident, as in any decoder whose embeddings are tied."""
    count: dict[type, int] = {}
    for _, b in blocks:
        count[type(b)] = count.get(type(b), 0) + 1
    return [(n, b) for n, b in blocks if count[type(b)] > 1 or not _shares_outside(root, n, b)]


def _suggest(root: nn.Module) -> str:
    """`` (block_class='A' or 'B' would stream a level that shares no weights)``: the classes found in a
    ModuleList or Sequential whose instances share no weight with anything outside themselves, most instances
    first; '' if there are none."""
    members: dict[type, list[tuple[str, nn.Module]]] = {}
    for m in root.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            for c in m.children():
                if _has_params(c):
                    members.setdefault(type(c), [])
    for path, m in root.named_modules(remove_duplicate=False):
        if type(m) in members:
            members[type(m)].append((path, m))
    ok = [(len(found), c.__name__) for c, found in members.items()
          if len({id(m) for _, m in found}) == len(found) and not any(_shares_outside(root, p, m) for p, m in found)]
    if not ok:
        return ""
    names = [n for _, n in sorted(ok, key=lambda x: (-x[0], x[1]))[:3]]
    return f" (block_class={' or '.join(repr(n) for n in names)} would stream a level that shares no weights)"
