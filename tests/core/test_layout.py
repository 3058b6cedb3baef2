"""The project's top-level packages do not shadow an installed distribution.

Python puts the project's root first on ``sys.path`` (``run.py``, ``python -m tests``),
so a top-level folder with an ``__init__.py`` wins over any installed package of the same
import name, and a dependency that imports that package gets ours. This happened: the
paged-attention kernels were a top-level ``kernels/``, and transformers 5.25 requires
Hugging Face's ``kernels`` distribution and imports it on ``import transformers``; every
model-loading test failed with "cannot import name 'CUDAProperties' from 'kernels'".
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def top_level_packages() -> list[str]:
    # ``tests`` is left out: some distributions wrongly ship a top-level ``tests``, and
    # nothing we depend on imports one.
    return sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")


def test_the_project_has_the_top_level_packages_it_packages():
    assert {"testbed", "policies", "traces", "experiments"} <= set(top_level_packages())


def own_distribution() -> str:
    """The project's own distribution (``[project] name``): installed editable by the
    bootstrap, it provides our top-level packages rather than shadowing them."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]


def shadowed(installed: dict[str, list[str]], packages: list[str], own: str) -> dict:
    """Each of ``packages`` that a distribution other than ``own`` also provides."""
    return {
        name: others
        for name in packages
        if (others := [d for d in installed.get(name, []) if d != own])
    }


def test_only_our_own_distribution_may_provide_our_package_names():
    installed = {"testbed": ["testbed"], "kernels": ["kernels"], "traces": ["testbed", "traces"]}
    found = shadowed(installed, ["testbed", "kernels", "traces", "policies"], own="testbed")
    assert found == {"kernels": ["kernels"], "traces": ["traces"]}


def test_no_top_level_package_shares_its_import_name_with_an_installed_distribution():
    installed = importlib.metadata.packages_distributions()
    clashes = shadowed(installed, top_level_packages(), own_distribution())
    assert not clashes, (
        f"top-level packages of {ROOT.name}/ shadow installed distributions (import name: "
        f"distributions): {clashes}; move or rename ours"
    )


PACKAGES = ("testbed", "policies", "traces", "experiments")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports at run time, wherever in it (a function's
    local imports too; not those under ``if TYPE_CHECKING``)."""
    import ast

    tree = ast.parse(path.read_text())
    skip = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
        for stmt in branch.body
        for node in ast.walk(stmt)
    }
    package = module_name(path) if path.name == "__init__.py" else module_name(path.parent)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            for alias in node.names:  # a submodule imported by name is an edge to it
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {module_name(p): p for p in files}
    return {name: imports_of(path, set(modules)) - {name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_project_imports_itself_through_others():
    # Function-local imports count: deferring an import hides a circle, it does
    # not remove it.
    graph = import_graph()
    assert "testbed.job" in graph and "testbed.build" in graph["testbed.job"]
    assert not cycles(graph), f"import circles: {cycles(graph)}"
