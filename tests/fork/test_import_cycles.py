"""No import cycle runs through the fork's own modules (the overlay's files).

Every import counts, at module level or inside a function or method: a function-level import only hides a cycle until
the function runs. Imports under ``if TYPE_CHECKING:`` never run and are left out. The graph is read with ``ast``
(nothing is imported, so modules that need FairScale or a GPU are covered too).

Its nodes are the fork's modules and the upstream modules that the series makes import one of them (the hooks, e.g.
``strategies/fully_sharded.py``), read from the built ``pytorch_lightning/``: a fork module that imports its own hook
closes a cycle through it. Other upstream modules are left out: through ``import pytorch_lightning``, which every
module runs first, each upstream module reaches every other, a cycle the fork neither makes nor can break.
"""
import ast
import re
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

from fork_tools.materialize import PACKAGE

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "overlay"
TREE = ROOT / PACKAGE  # the built tree: upstream + series + overlay

# importing module -> imported module -> the import lines ("file:line") that make the edge
Graph = Dict[str, Dict[str, List[str]]]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def runtime_imports(tree: ast.AST) -> Iterator[ast.stmt]:
    """Every import statement that can run, at any depth, skipping the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and is_type_checking(node.test):
            stack.extend(node.orelse)  # an ``else:`` branch does run
        else:
            stack.extend(ast.iter_child_nodes(node))


def imported_modules(node: ast.stmt, module: str, is_package: bool, modules: Set[str]) -> Iterator[str]:
    """The modules of ``modules`` whose code the import statement needs: each module it names; for
    ``from a.b import c``, a.b.c if that is a module, else a.b (whose body defines c). The packages above a module
    are not counted: a package's ``__init__`` has begun running before any module in it can run."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    for alias in node.names:
        yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base


def add_edges(graph: Graph, module: str, path: Path, modules: Set[str]) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    edges = graph.setdefault(module, {})
    for node in runtime_imports(tree):
        for target in imported_modules(node, module, path.name == "__init__.py", modules):
            if target in modules:
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                lines = edges.setdefault(target, [])
                if where not in lines:
                    lines.append(where)


@lru_cache(maxsize=None)  # read once for the tests here, which do not change it
def import_graph() -> Graph:
    """The imports among the fork's modules and their hooks."""
    if not (TREE / "__init__.py").is_file():
        pytest.fail(f"no built tree at {TREE}: run `python -m fork_tools materialize`")
    fork = {module_name(path, OVERLAY): path for path in sorted(OVERLAY.rglob("*.py"))}
    upstream = {
        name: path for path in sorted(TREE.rglob("*.py")) if (name := module_name(path, ROOT)) not in fork
    }
    modules = set(fork) | set(upstream)
    graph: Graph = {}
    for module, path in fork.items():
        add_edges(graph, module, path, modules)
    # the hooks: only upstream files that name a fork module are parsed (reading all of them takes most of a second)
    mentions = re.compile("|".join(sorted({re.escape(name.rsplit(".", 1)[-1]) for name in fork})))
    for module, path in upstream.items():
        if mentions.search(path.read_text()):
            add_edges(graph, module, path, modules)
    hooks = {module for module in upstream if any(target in fork for target in graph.get(module, {}))}
    nodes = set(fork) | hooks
    return {module: {t: w for t, w in graph[module].items() if t in nodes} for module in nodes}


def strongly_connected_components(graph: Graph) -> List[List[str]]:
    """Tarjan's algorithm (a few dozen nodes: recursion is fine)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def cycles(graph: Graph, fork: Set[str]) -> List[Tuple[List[str], List[str]]]:
    """Each cycle through a fork module: its modules (a strongly connected component, or one module importing itself)
    and the edges among them, each with the import lines that make it."""
    found = []
    for component in strongly_connected_components(graph):
        if not fork & set(component) or (len(component) == 1 and component[0] not in graph[component[0]]):
            continue
        edges = [
            f"  {source} -> {target}: {', '.join(graph[source][target])}"
            for source in component
            for target in sorted(graph[source])
            if target in component
        ]
        found.append((component, edges))
    return found


def fork_modules() -> Set[str]:
    return {module_name(path, OVERLAY) for path in OVERLAY.rglob("*.py")}


def test_graph_sees_the_fork_and_its_hooks():
    # against a test that passes because it read nothing
    graph = import_graph()
    checkpointer = "pytorch_lightning.strategies.fsdp_checkpointer"
    assert "pytorch_lightning.strategies.fsdp_checkpoint_state" in graph[checkpointer]
    assert checkpointer in graph["pytorch_lightning.strategies.fully_sharded"]


def test_imports_that_count():
    source = (
        "import typing\n"
        "from typing import TYPE_CHECKING\n"
        "import pytorch_lightning.u\n"
        "if TYPE_CHECKING:\n"
        "    from pytorch_lightning.x import hidden\n"
        "if typing.TYPE_CHECKING:\n"
        "    import pytorch_lightning.y\n"
        "else:\n"
        "    import pytorch_lightning.z\n"
        "def f():\n"
        "    from .w import g\n"
        "    from . import v\n"
        "    from .. import t\n"
    )
    modules = {"pytorch_lightning", "pytorch_lightning.a", "pytorch_lightning.a.v", "pytorch_lightning.a.w"}
    nodes = runtime_imports(ast.parse(source))
    names = {name for node in nodes for name in imported_modules(node, "pytorch_lightning.a.m", False, modules)}
    assert names == {
        "typing",
        "pytorch_lightning.u",
        "pytorch_lightning.z",
        "pytorch_lightning.a.w",  # g is defined in w
        "pytorch_lightning.a.v",  # a module
        "pytorch_lightning",  # t is not a module: the package's body defines it
    }


def test_cycles_are_reported_with_their_import_lines():
    graph: Graph = {"a": {"b": ["a.py:1"]}, "b": {"a": ["b.py:9"]}, "c": {"c": ["c.py:2"]}, "d": {"a": ["d.py:3"]}}
    assert cycles(graph, {"a", "c", "d"}) == [
        (["a", "b"], ["  a -> b: a.py:1", "  b -> a: b.py:9"]),
        (["c"], ["  c -> c: c.py:2"]),
    ]
    assert cycles(graph, {"d"}) == []  # cycles of upstream modules alone are not the fork's


def test_no_import_cycle_through_the_forks_modules():
    found = cycles(import_graph(), fork_modules())
    report = "\n".join(
        f"cycle of {len(component)} modules: {', '.join(component)}\n" + "\n".join(edges) for component, edges in found
    )
    assert not found, f"import cycles through the fork's modules (break one edge of each):\n{report}"
