"""The package's layout holds: no import cycle, a Lightning-free core, small modules, adapters without streams.

Read from the source (``ast``), so these hold for imports inside functions too, which a runtime check of
``sys.modules`` would miss until the function runs.
"""

from __future__ import annotations

import ast
import pathlib

import megatrain_lightning

PKG = pathlib.Path(megatrain_lightning.__file__).parent
NAME = "megatrain_lightning"
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")
# Modules that must import nothing from Lightning, directly or through any module of the package they import.
LIGHTNING_FREE = ("engine", "optim", "plan", "config", "host_memory", "hardware")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([NAME, *parts])] = f
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> tuple[set[str], set[str]]:
    """(modules of the package, top-level external packages) that ``name`` imports anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    internal: set[str] = set()
    external: set[str] = set()

    def add(target: str, names: list[str]) -> None:
        if target != NAME and not target.startswith(NAME + "."):
            external.add(target.split(".")[0])
            return
        hits = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
        if hits:
            internal.update(hits)
        if len(hits) < len(names) or not names:
            mod = target
            while mod not in MODULES:  # `from pkg.module import name`
                mod = mod.rsplit(".", 1)[0]
            internal.add(mod)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, [])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            add(target, [a.name for a in node.names])
    internal.discard(name)
    return internal, external


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_no_import_cycle_inside_the_package() -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node][0]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_core_imports_nothing_from_lightning() -> None:
    roots = [m for m in GRAPH if any(m == f"{NAME}.{r}" or m.startswith(f"{NAME}.{r}.") for r in LIGHTNING_FREE)]
    assert len(roots) >= 20
    for root in roots:
        seen, stack = set(), [root]
        while stack:
            m = stack.pop()
            if m in seen:
                continue
            seen.add(m)
            internal, external = GRAPH[m]
            bad = external & set(LIGHTNING)
            assert not bad, f"{root} reaches {m}, which imports {sorted(bad)}"
            stack.extend(internal)


def test_engine_modules_stay_small() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PKG / "engine").glob("*.py")}
    assert len(sizes) >= 10 and max(sizes.values()) < 400, sizes


def test_the_lightning_adapters_know_no_streams() -> None:
    stream_words = {"Stream", "Event", "wait_event", "wait_stream", "record_stream", "streams", "synchronize"}
    for name in ("strategy.py", "precision.py"):
        tree = ast.parse((PKG / name).read_text())
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        used |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert not used & stream_words, f"{name} uses {sorted(used & stream_words)}"


def test_the_graph_sees_imports(tmp_path: pathlib.Path) -> None:
    """The checks above read real edges: the strategy imports the engine, the engine no optimizer."""
    strategy_imports = GRAPH[f"{NAME}.strategy"][0]
    assert f"{NAME}.engine" in strategy_imports and f"{NAME}.optim" in strategy_imports
    assert "lightning" in GRAPH[f"{NAME}.strategy"][1]
    engine_imports = GRAPH[f"{NAME}.engine.engine"][0]
    assert f"{NAME}.engine.grads" in engine_imports and not any(m.startswith(f"{NAME}.optim") for m in engine_imports)


def test_no_stream_waits_for_itself() -> None:
    """``streams.after_compute(s)`` makes ``s`` wait for the compute stream, which is the *current* stream: inside
    ``with streams.on(s)`` that is ``s`` itself, and the wait orders nothing (the device update's copy home raced its
    AdamW so until 2026-12-03). No call of it may sit inside such a block, anywhere in the package."""
    bad = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.With):
                continue
            if not any(isinstance(i.context_expr, ast.Call) and isinstance(i.context_expr.func, ast.Attribute)
                       and i.context_expr.func.attr == "on" for i in node.items):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) \
                        and inner.func.attr == "after_compute":
                    bad.append(f"{name}:{inner.lineno}")
    assert not bad, bad
