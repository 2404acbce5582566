"""The package's layering, read from the source (AST, nothing imported): the learner and eval do
not import the generator's internals (what they share lives in ``vapo_async.common``), ``common``
imports none of the process packages, and no two modules of ``vapo_async`` import each other,
directly or around a circle, counting imports inside functions too (only ``if TYPE_CHECKING:``
blocks are left out: they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "vapo_async"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imported(module: str) -> set[str]:
    """The ``vapo_async`` modules ``module`` imports anywhere in its body (a ``from P import x``
    of a submodule ``P.x`` counts as ``P.x``, of anything else as ``P``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while todo:
        for node in ast.iter_child_nodes(todo.pop()):
            if _type_checking_only(node):
                continue
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from .x import y (level 1 = this package)
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                out.update(f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names)
            todo.append(node)
    return {m for m in out if m in MODULES and m != module}


GRAPH = {m: imported(m) for m in MODULES}


def test_the_graph_sees_imports_of_every_kind() -> None:
    """The reader finds what these modules are known to import: top level, inside a function,
    relative, and a submodule named in ``from P import sub``."""
    assert "vapo_async.common.engine" in GRAPH["vapo_async.generator.config"]  # top level
    assert "vapo_async.common.orphans" in GRAPH["vapo_async.learner.__main__"]  # inside run()
    assert "vapo_async.eval.metrics" in GRAPH["vapo_async.eval.runner"]  # from .metrics import ...
    assert "vapo_async.learner.config" not in GRAPH["vapo_async.learner.placement"]  # TYPE_CHECKING only


@pytest.mark.parametrize("package", ["learner", "eval"])
def test_learner_and_eval_do_not_import_the_generator(package: str) -> None:
    found = {m: sorted(d for d in deps if d.startswith("vapo_async.generator"))
             for m, deps in GRAPH.items() if m.startswith(f"vapo_async.{package}")}
    assert not {m: d for m, d in found.items() if d}, "use vapo_async.common for what they share"


def test_common_imports_no_process_package() -> None:
    process = ("learner", "generator", "controller", "eval")
    found = {m: sorted(d for d in deps if d.split(".")[1] in process)
             for m, deps in GRAPH.items() if m.startswith("vapo_async.common")}
    assert not {m: d for m, d in found.items() if d}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_circle_and_only_that() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle() -> None:
    assert _cycles(GRAPH) == []
