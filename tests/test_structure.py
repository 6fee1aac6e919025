"""The package's shape: no private name crosses a package boundary, no import circle.

Both read the source with :mod:`ast` (nothing is imported), so they see function-level
imports too.

A *package* here is a sub-package of vitlab (``vitlab.record``, ``vitlab.relevance``, ...):
its modules may share private names among themselves. Each top-level module
(``vitlab/attention.py``, ...) is its own package: a name it keeps private stays inside it.
"""
from __future__ import annotations

import ast
from pathlib import Path

VITLAB = Path(__file__).resolve().parent.parent / "vitlab"


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of vitlab."""
    out = {}
    for path in sorted(VITLAB.rglob("*.py")):
        parts = list(path.relative_to(VITLAB.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _package_of(module: str) -> str:
    """The package whose privates ``module`` may use: its sub-package, or itself at top level."""
    parts = module.split(".")
    if len(parts) >= 3 or _is_package(module):
        return ".".join(parts[:2])
    return module


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``from ... import`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in ``module``'s source,
    module-level and inside functions. ``from vitlab.x import y`` where ``vitlab.x.y`` is a
    module counts as an import of that module."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("vitlab"):
                    found.append((alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            if not source.startswith("vitlab"):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in MODULES:
                    found.append((sub, None, node.lineno))
                else:
                    found.append((source, alias.name, node.lineno))
    return found


def _attribute_uses(module: str) -> list[tuple[str, str, int]]:
    """``vitlab.x._name`` written out as an attribute chain: (module, name, line)."""
    tree = ast.parse(MODULES[module].read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name):
                dotted = ".".join([value.id, *reversed(chain)])
                if dotted in MODULES:
                    found.append((dotted, node.attr, node.lineno))
    return found


def _private_crossings() -> list[str]:
    bad = []
    for module in MODULES:
        uses = [(src, name, line) for src, name, line in _imports(module) if name is not None]
        uses += _attribute_uses(module)
        # importing a private module itself (vitlab.record._session) is judged like a private name
        uses += [(src.rsplit(".", 1)[0], src.rsplit(".", 1)[1], line)
                 for src, name, line in _imports(module) if name is None and src.rsplit(".", 1)[-1].startswith("_")]
        for src, name, line in uses:
            if not name.startswith("_") or name.startswith("__"):
                continue
            if _package_of(src) != _package_of(module):
                bad.append(f"{MODULES[module].relative_to(VITLAB.parent)}:{line}: {module} uses {src}.{name}")
    return bad


def test_private_names_stay_in_their_package():
    bad = _private_crossings()
    assert not bad, "private names imported across packages (make them public):\n" + "\n".join(bad)


def _graph() -> dict[str, set[str]]:
    """module -> the vitlab modules it imports (a package's import of its own sub-modules
    included; ``from vitlab import x`` counts as importing vitlab)."""
    graph = {}
    for module in MODULES:
        targets = set()
        for src, _name, _line in _imports(module):
            while src and src not in MODULES:  # vitlab.x.y where y is a name: the module vitlab.x
                src = src.rpartition(".")[0]
            if src and src != module:
                targets.add(src)
        graph[module] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _cycle_path(graph, component):
    """One circle through the component, for the message: a -> b -> ... -> a."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    while True:
        nxt = next((w for w in sorted(graph[path[-1]]) if w in members and w == start and len(path) > 1), None)
        if nxt:
            return " -> ".join(path + [start])
        nxt = next((w for w in sorted(graph[path[-1]]) if w in members and w not in seen), None)
        if nxt is None:  # dead end: close through any member that leads back
            back = next(w for w in sorted(graph[path[-1]]) if w in members)
            return " -> ".join(path + [back])
        path.append(nxt)
        seen.add(nxt)


def _without_package_edges(graph):
    """Drop a package __init__'s imports of its own sub-modules and their imports of the
    __init__ (``from vitlab.record import X`` inside record/): Python resolves these by the
    package's loading order, they are the package's own wiring, not arrows between rooms.
    The top-level ``vitlab`` package, which re-exports the whole library lazily, is left out."""
    out = {}
    for module, targets in graph.items():
        if module == "vitlab":
            continue
        kept = set()
        for t in targets:
            if t == "vitlab":
                continue
            if _is_package(module) and t.startswith(module + "."):
                continue
            if _is_package(t) and module.startswith(t + "."):
                continue
            kept.add(t)
        out[module] = kept
    return out


def test_no_import_circle():
    graph = _without_package_edges(_graph())
    circles = _cycles(graph)
    assert not circles, "import circles among vitlab modules:\n" + "\n".join(
        f"{', '.join(c)}\n  e.g. {_cycle_path(graph, c)}" for c in circles)


def test_the_checks_see_what_they_should():
    """The scanners find a known private crossing and a known circle in made-up sources."""
    graph = {"vitlab.a": {"vitlab.b"}, "vitlab.b": {"vitlab.c"}, "vitlab.c": {"vitlab.a"}, "vitlab.d": {"vitlab.a"}}
    assert _cycles(graph) == [["vitlab.a", "vitlab.b", "vitlab.c"]]
    assert _package_of("vitlab.record._session") == _package_of("vitlab.record.vit") == "vitlab.record"
    assert _package_of("vitlab.record") == "vitlab.record"
    assert _package_of("vitlab.attention") != _package_of("vitlab.rollout")
    node = ast.parse("from ._session import _Session").body[0]
    assert _resolve("vitlab.record.vit", node) == "vitlab.record._session"
    assert _resolve("vitlab.record", node) == "vitlab.record._session"


def test_every_record_adapter_module_is_declared_once_in_adapters():
    """A family is one adapter module in vitlab/record/ and one entry of record.ADAPTERS: every
    adapter module's attach function is listed, each attach function once per family."""
    import sys

    import vitlab  # noqa: F401  (vitlab.record the name is the function; the module is in sys.modules)

    rec = sys.modules["vitlab.record"]
    modules = {a.attach.__module__ for a in rec.ADAPTERS}
    files = {f"vitlab.record.{p.stem}" for p in (VITLAB / "record").glob("*.py")
             if p.stem not in ("__init__", "_session", "lrp", "lrp_direct")}
    assert files == modules, (files - modules, modules - files)
    pairs = [(a.family, a.attach) for a in rec.ADAPTERS]
    assert len(pairs) == len(set(pairs))
    assert all(a.models and a.models in rec.SUPPORTED for a in rec.ADAPTERS)
