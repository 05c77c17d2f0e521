"""No import circles anywhere in the project: the package, the recipes and the scripts, counting imports inside
functions too. Read from the source (nothing is imported), so a circle that only bites at call time shows here.

Scripts import each other by bare file name (scripts/README.md), so their names must be unique across folders."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

from tests.launch import ROOT

TREES = ("hf_fsdp2", "recipes", "scripts")


def modules() -> dict[str, str]:
    """Every module's dotted name (from the repository root) and its path."""
    found = {}
    for tree in TREES:
        for where, _, names in os.walk(os.path.join(ROOT, tree)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(where, name)
                    dotted = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
                    found[dotted.removesuffix(".__init__")] = path
    return found


def script_names(found: dict[str, str]) -> dict[str, list[str]]:
    """Each script's bare name and the modules that carry it."""
    names: dict[str, list[str]] = {}
    for dotted in found:
        if dotted.startswith("scripts."):
            names.setdefault(dotted.rsplit(".", 1)[1], []).append(dotted)
    return names


def imported(dotted: str, path: str) -> Iterator[str]:
    """The names every import statement of the module mentions, relative ones made absolute."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    package = dotted.split(".") if path.endswith("__init__.py") else dotted.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    """Module → the project's modules it imports (scripts' bare names resolved to their folder)."""
    found = modules()
    bare = {name: owners[0] for name, owners in script_names(found).items()}
    graph = {}
    for dotted, path in found.items():
        targets = {bare.get(name, name) if dotted.startswith("scripts.") else name for name in imported(dotted, path)}
        graph[dotted] = {t for t in targets if t in found and t != dotted}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is None:
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
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_script_names_are_unique_across_folders():
    assert not {name: owners for name, owners in script_names(modules()).items() if len(owners) > 1}


def test_no_module_imports_itself_back_through_others():
    graph = import_graph()
    assert graph["scripts.benchmark.benchmark"], "the graph found no imports: the walk is broken"
    assert not circles(graph)


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
