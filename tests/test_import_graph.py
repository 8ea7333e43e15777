"""No import cycles anywhere in the tokenplane package.

The module graph is read from the source with `ast` (nothing is imported): every `import` and `from ... import`
statement counts, at module level or inside a function (a lazy import that points upward is still a cycle), including
`from . import x` where x is a submodule. Imports under `if TYPE_CHECKING:` are type names only, never executed,
and are left out. The implicit import of a module's parent packages is left out too (Python initializes parents
first, so it cannot form a cycle of partially initialized modules).

Run directly for the graph's summary: `python tests/test_import_graph.py`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tokenplane"


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    out: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return out


def build_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base_parts = package.split(".")
                    base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = []
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in files else base)
            for target in targets:
                # `import a.b.c` names module a.b.c (or the deepest of its prefixes that is ours)
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles_in_tokenplane():
    found = cycles(build_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


# tokenize/, bottom layer first: a module may import its own layer and the ones before it, never a later one.
TOKENIZE_LAYERS = [["errors"], ["reference"], ["spec"], ["cpu"], ["gpu"], ["router"], ["batch"], ["packedrun", "textstore", "splice", "nfcmap", "records"],
                   ["repair", "appendwin", "asciiappend", "plan"], ["session"], ["tokenizer"], ["registry"], ["verify", "warmup"],
                   ["evidence"]]


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["tokenplane", "tokenize"] or len(parts) < 3:
        return None     # outside tokenize/, or the package facade (tokenize/__init__.py)
    return next(i for i, names in enumerate(TOKENIZE_LAYERS) if parts[2] in names)


def test_tokenize_dependencies_point_down():
    graph = build_graph()
    upward = [f"{mod} -> {dep}" for mod, deps in sorted(graph.items()) for dep in sorted(deps)
              if _layer(mod) is not None and (_layer(dep) is None and dep.startswith("tokenplane.tokenize")
                                               or (_layer(dep) or 0) > _layer(mod))]
    assert not upward, "tokenize/ imports that point up:\n" + "\n".join(upward)


def test_reference_and_errors_import_nothing_of_ours():
    """The shadow verifier's fresh engine shares no code with the fast paths it checks."""
    graph = build_graph()
    assert graph["tokenplane.tokenize.reference"] == set()
    assert graph["tokenplane.tokenize.errors"] == set()


def test_checker_sees_relative_and_lazy_imports(tmp_path):
    pkg = tmp_path / "tokenplane"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .a import g\n")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    graph = build_graph(pkg)
    assert graph["tokenplane.sub.c"] == set()
    assert cycles(graph) == [["tokenplane.sub.a", "tokenplane.sub.b"]]


def main() -> int:
    graph = build_graph()
    found = cycles(graph)
    edges = sum(len(v) for v in graph.values())
    print(f"{len(graph)} modules, {edges} import edges under {ROOT.name}/; cycles: {len(found)}")
    for comp in found:
        print("  cycle:", " <-> ".join(comp))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
