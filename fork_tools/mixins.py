"""Static checks of the overlay's mixins against the upstream classes they are mixed into (``check`` runs them).

Upstream classes get the fork's methods through mixin base classes defined in overlay modules, e.g.
``class DDPFullyShardedStrategy(FSDPStreamingSaveMixin, DDPStrategy)``. Python resolves such methods by the MRO,
so two kinds of drift pass silently at import time and only show when the code runs, if at all:

- a mixin method marked ``@override`` overrides nothing: no class after the mixin in the host's MRO defines the
  name (upstream renamed or removed it, e.g. ``Strategy.optimizer_state``), so upstream never calls it;
- a mixin method is shadowed: the host's own body, or a class before the mixin in its MRO, defines the same name
  without calling ``super()``, so the mixin's method never runs.

An undecorated mixin method that overrides a later class's is reported too (it lacks ``@override``).

This reads the materialised tree with ``ast`` and imports nothing: a host's base names are resolved through its
module's imports (``from X import Y``, ``import X``) to classes defined in tree files, and the MRO is C3's (left to
right depth first, last occurrence kept, should C3 fail). A class from outside the tree (``ABC``,
``torch.nn.Module``) ends the walk: it is not looked into. Hosts are the tree's classes whose direct bases include
a class defined in an overlay module; every overlay class in a host's MRO is checked as a mixin.
"""
import ast
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

from fork_tools.overlay import absolute_import, module_name
from fork_tools.series import Tree

_BLOCKS = (ast.If, ast.Try, ast.With)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _top_level(body: List[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's statements, including those inside top-level ``if``/``try``/``with`` blocks."""
    for node in body:
        yield node
        if isinstance(node, _BLOCKS):
            for field in ("body", "orelse", "finalbody"):
                yield from _top_level(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                yield from _top_level(handler.body)


def _defines(node: ast.ClassDef) -> Dict[str, ast.stmt]:
    """Names a class body binds (methods, attributes), each with its first definition."""
    names: Dict[str, ast.stmt] = {}
    for stmt in node.body:
        if isinstance(stmt, _FUNCTIONS):
            names.setdefault(stmt.name, stmt)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                if isinstance(target, ast.Name):
                    names.setdefault(target.id, stmt)
    return names


def _is_override(func: ast.stmt) -> bool:
    for decorator in getattr(func, "decorator_list", []):
        if isinstance(decorator, ast.Name) and decorator.id == "override":
            return True
        if isinstance(decorator, ast.Attribute) and decorator.attr == "override":
            return True
    return False


def _calls_super(node: ast.stmt, name: str) -> bool:
    """Whether a definition reaches the next class's ``name`` through ``super().name``."""
    return any(
        isinstance(sub, ast.Attribute)
        and sub.attr == name
        and isinstance(sub.value, ast.Call)
        and isinstance(sub.value.func, ast.Name)
        and sub.value.func.id == "super"
        for sub in ast.walk(node)
    )


class _Module:
    def __init__(self, path: str, source: str):
        self.path = path
        self.name = module_name(path)
        self.classes: Dict[str, ast.ClassDef] = {}
        # local name -> (module, name in it), or (module, None) for a module bound by ``import``
        self.imports: Dict[str, Tuple[str, Optional[str]]] = {}
        for node in _top_level(ast.parse(source, filename=path).body):
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, node)
            elif isinstance(node, ast.ImportFrom):
                module = absolute_import(path, node.module, node.level)
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = (module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.imports[alias.asname] = (alias.name, None)
                    else:
                        top = alias.name.split(".")[0]
                        self.imports[top] = (top, None)


class ClassIndex:
    """The classes of a tree, their resolved bases and their MROs. Keys are ``module.Class``; a base from outside
    the tree is kept as the name it was written with, which is in no tree module's classes."""

    def __init__(self, tree: Tree):
        self.sources = {module_name(p): (p, text) for p, text in tree.items() if p.endswith(".py")}
        self._modules: Dict[str, Optional[_Module]] = {}
        self._mros: Dict[str, List[str]] = {}

    def module(self, name: str) -> Optional[_Module]:
        if name not in self._modules:
            found = self.sources.get(name)
            try:
                self._modules[name] = _Module(*found) if found else None
            except SyntaxError:
                self._modules[name] = None
        return self._modules[name]

    def node(self, key: str) -> Optional[ast.ClassDef]:
        module, _, name = key.rpartition(".")
        mod = self.module(module)
        return mod.classes.get(name) if mod else None

    def path(self, key: str) -> str:
        return self.sources[key.rpartition(".")[0]][0]

    def lookup(self, module: str, name: str, seen: Optional[Set[str]] = None) -> str:
        """The key of class ``name`` as module ``module`` has it (defined there or imported into it)."""
        seen = seen or set()
        mod = self.module(module)
        if mod is None or f"{module}.{name}" in seen:
            return f"{module}.{name}"
        if name in mod.classes:
            return f"{module}.{name}"
        seen.add(f"{module}.{name}")
        target, attr = mod.imports.get(name, (None, None))
        return self.lookup(target, attr, seen) if target and attr else f"{module}.{name}"

    def resolve(self, mod: _Module, expr: ast.expr) -> str:
        parts: List[str] = []
        while isinstance(expr, ast.Attribute):
            parts.insert(0, expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return ast.unparse(expr)
        head = expr.id
        if not parts and head in mod.classes:
            return f"{mod.name}.{head}"
        if head not in mod.imports:
            return ".".join([head] + parts)
        module, attr = mod.imports[head]
        if not parts:
            return self.lookup(module, attr) if attr else module
        dotted = ([module] if attr is None else [module, attr]) + parts
        return self.lookup(".".join(dotted[:-1]), dotted[-1])

    def bases(self, key: str) -> List[str]:
        node = self.node(key)
        if node is None:
            return []
        mod = self.module(key.rpartition(".")[0])
        return [self.resolve(mod, base) for base in node.bases]

    def mro(self, key: str, active: Optional[Set[str]] = None) -> List[str]:
        if key in self._mros:
            return self._mros[key]
        active = active or set()
        if key in active:  # a cycle through unresolved names; stop here
            return [key]
        active.add(key)
        bases = self.bases(key)
        parents = [self.mro(base, active) for base in bases]
        result = [key] + (_c3(parents + [bases]) or _depth_first(parents))
        active.discard(key)
        self._mros[key] = result
        return result


def _c3(sequences: List[List[str]]) -> Optional[List[str]]:
    sequences = [list(seq) for seq in sequences if seq]
    result: List[str] = []
    while sequences:
        for seq in sequences:
            head = seq[0]
            if not any(head in other[1:] for other in sequences):
                break
        else:
            return None  # inconsistent hierarchy
        result.append(head)
        sequences = [[c for c in seq if c != head] for seq in sequences]
        sequences = [seq for seq in sequences if seq]
    return result


def _depth_first(parents: List[List[str]]) -> List[str]:
    flat = [key for mro in parents for key in mro]
    return [key for i, key in enumerate(flat) if key not in flat[i + 1 :]]


def mixin_problems(tree: Tree, overlay_paths: Set[str], shown: Callable[[str], str] = str) -> List[str]:
    """Mixin drift in ``tree`` (see the module docstring), one line each; ``shown`` maps a tree path to how a
    message names it (the overlay modules' own paths under ``overlay/``)."""
    index = ClassIndex(tree)
    mixin_modules = {module_name(p) for p in overlay_paths if p.endswith(".py")}
    mixins = {f"{m}.{name}" for m in mixin_modules if index.module(m) for name in index.module(m).classes}
    if not mixins:
        return []
    names = {key.rpartition(".")[2] for key in mixins}
    problems: List[str] = []
    for module in sorted(index.sources):
        path, text = index.sources[module]
        if not any(name in text for name in names):
            continue  # a module that never names a mixin cannot host one
        mod = index.module(module)
        for host in sorted(mod.classes) if mod else []:
            key = f"{module}.{host}"
            if set(index.bases(key)) & mixins:
                problems += _host_problems(index, key, mixins, shown)
    return problems


def _where(index: ClassIndex, key: str, node: ast.AST, shown: Callable[[str], str]) -> str:
    return f"{shown(index.path(key))}:{node.lineno}"


def _host_problems(index: ClassIndex, host: str, mixins: Set[str], shown: Callable[[str], str]) -> List[str]:
    mro = index.mro(host)
    host_name = host.rpartition(".")[2]
    problems = []
    for position, mixin in enumerate(mro):
        if mixin not in mixins:
            continue
        mixin_name = mixin.rpartition(".")[2]
        before = [key for key in mro[:position] if index.node(key) is not None]
        after = [key for key in mro[position + 1 :] if index.node(key) is not None]
        defs = {key: _defines(index.node(key)) for key in before + after}
        methods = [stmt for stmt in index.node(mixin).body if isinstance(stmt, _FUNCTIONS)]
        # A property's setter repeats its name; the name counts as decorated if any of its definitions is.
        decorated = {m.name for m in methods if _is_override(m)}
        first: Dict[str, ast.stmt] = {}
        for method in methods:
            first.setdefault(method.name, method)
        for method in first.values():
            name, at = method.name, _where(index, mixin, method, shown)
            overridden = [key for key in after if name in defs[key]]
            shadows = [key for key in before if name in defs[key] and not _calls_super(defs[key][name], name)]
            if name in decorated and not overridden and not (name.startswith("__") and hasattr(object, name)):
                searched = ", ".join(key.rpartition(".")[2] for key in after) or "no class of the tree"
                problems.append(
                    f"{at}: {mixin_name}.{name} is marked @override, but no class after it in {host_name}'s MRO "
                    f"({searched}) defines {name}: renamed or removed upstream?"
                )
            if name not in decorated and overridden:
                problems.append(
                    f"{at}: {mixin_name}.{name} overrides {overridden[0].rpartition('.')[2]}.{name} in "
                    f"{host_name}'s MRO but is not marked @override"
                )
            if shadows:
                first = shadows[0]
                problems.append(
                    f"{at}: {mixin_name}.{name} never runs in {host_name}: {first.rpartition('.')[2]} "
                    f"({_where(index, first, defs[first][name], shown)}) defines {name} before it in the MRO "
                    f"without calling super().{name}"
                )
    return problems
