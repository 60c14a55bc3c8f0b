"""The import graph of diloco/, read from the source (nothing is imported): the object store imports
only the algorithm, the algorithm nothing above it, and neither packages nor modules import each
other in a circle (docs/design.md#layers)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]



def module_imports() -> dict[str, set[str]]:
    """Each diloco module -> the diloco modules it imports anywhere in its code (a function's
    import too: it runs as surely, only later)."""
    out = {}
    for path in (ROOT / "diloco").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # from diloco.hf import chat imports the module diloco.hf.chat (and runs
                # diloco/hf/__init__.py first, an edge the package's own modules do not count)
                subs = {f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")}
                found |= subs
                if len(subs) < len(node.names) or node.module == "diloco":
                    found.add(node.module)
        out[name] = {m for m in found if m.startswith("diloco.") and m != name}
        if path.name != "__init__.py":  # a module importing its own package's names
            out[name] = {m for m in out[name] if not name.startswith(m + ".")}
    return out


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def package(module: str) -> str:
    """diloco.store.exchange -> diloco.store; diloco.run -> diloco.run."""
    return ".".join(module.split(".")[:2])


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for mod, targets in module_imports().items():
        graph.setdefault(package(mod), set()).update(package(t) for t in targets if package(t) != package(mod))
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or w != v:
                w = stack.pop()
                component.add(w)
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_circle_finder_finds_a_circle_and_only_that():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_store_imports_only_the_algorithm():
    graph = package_graph()
    assert graph["diloco.store"] == {"diloco.algo"}
    assert "diloco.store" in graph["diloco.config"]  # the S3 option checks, with no arrow into runtime/


def test_the_algorithm_imports_nothing_above_it():
    assert package_graph()["diloco.algo"] == set()


def test_no_import_circle_between_packages_or_modules():
    """A package that imports another which imports it back, at any distance, is a circle; so is
    one between modules (a function's import included). A module's import of names its own
    package's __init__ re-exports is not counted: __init__ runs first either way."""
    assert circles(package_graph()) == []
    assert circles(module_imports()) == []
