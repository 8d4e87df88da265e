"""Static check that the fork's overrides of upstream methods still have a target (``check`` runs it).

The fork's classes override upstream methods (a strategy method, a connector method), whether they are base classes
mixed into an upstream class by a hook, classes of their own deriving from an upstream class, or methods a patch adds
to an upstream class. Python resolves such methods by the MRO, so drift passes silently at import time: a method
marked ``@override`` whose name no later class in the MRO defines any more (upstream renamed or removed it, e.g.
``Strategy.optimizer_state``) is never called by upstream. So every ``@override`` method of the tree must have a
target, and an overlay class's method that overrides one without the decorator is reported too (it would escape the
first check).

A class's methods may override in its own MRO and in the MRO of every tree class deriving from it (a base class with
no upstream base of its own overrides only in its hosts); the check looks in all of them, whichever classes exist.
That a hook's other touch points (imports, call sites) still exist is checked by applying the patches by exact
context; that no overlay module shadows an upstream file, by ``overlay.overlay_problems``.

This reads the materialised tree with ``ast`` and imports nothing: base names are resolved through their module's
imports (``from X import Y``, ``import X``) to classes defined in tree files, and the MRO is C3's (left to right
depth first, last occurrence kept, should C3 fail). A class from outside the tree (``ABC``, ``torch.nn.Module``)
ends the walk: it is not looked into.
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


def override_problems(tree: Tree, overlay_paths: Set[str], shown: Callable[[str], str] = str) -> List[str]:
    """Overrides without a target in ``tree`` (see the module docstring), one line each; ``overlay_paths`` are the
    overlay modules' tree paths, and ``shown`` maps a tree path to how a message names it."""
    index = ClassIndex(tree)
    overlay_modules = {module_name(p) for p in overlay_paths if p.endswith(".py")}
    problems: List[str] = []
    for key in _classes_with_overrides(index, overlay_modules):
        problems += _class_problems(index, key, key.rpartition(".")[0] in overlay_modules, shown)
    return problems


def _methods(node: ast.ClassDef) -> List[ast.stmt]:
    return [stmt for stmt in node.body if isinstance(stmt, _FUNCTIONS)]


def _classes_with_overrides(index: "ClassIndex", overlay_modules: Set[str]) -> Iterator[str]:
    """The keys of the overlay modules' classes and of the other tree classes with an ``@override`` method."""
    for module in sorted(index.sources):
        in_overlay = module in overlay_modules
        mod = index.module(module) if in_overlay or "override" in index.sources[module][1] else None
        for name, node in sorted(mod.classes.items()) if mod else []:
            if in_overlay or any(_is_override(method) for method in _methods(node)):
                yield f"{module}.{name}"


def _mros_through(index: "ClassIndex", key: str) -> List[List[str]]:
    """The MRO of class ``key`` and those of the tree classes deriving from it: where its methods override."""
    name = key.rpartition(".")[2]
    mros = [index.mro(key)]
    for module in sorted(index.sources):
        mod = index.module(module) if name in index.sources[module][1] else None
        for other in sorted(mod.classes) if mod else []:
            mro = index.mro(f"{module}.{other}")
            if mro[0] != key and key in mro:
                mros.append(mro)
    return mros


def _class_problems(index: "ClassIndex", key: str, in_overlay: bool, shown: Callable[[str], str]) -> List[str]:
    mros = _mros_through(index, key)
    later = list(dict.fromkeys(k for mro in mros for k in mro[mro.index(key) + 1 :] if index.node(k) is not None))
    defs = {k: _defines(index.node(k)) for k in later}
    methods = _methods(index.node(key))
    # A property's setter repeats its name; the name counts as decorated if any of its definitions is.
    decorated = {m.name for m in methods if _is_override(m)}
    first: Dict[str, ast.stmt] = {}
    for method in methods:
        first.setdefault(method.name, method)
    class_name, hosts = key.rpartition(".")[2], ", ".join(mro[0].rpartition(".")[2] for mro in mros)
    problems = []
    for name, method in first.items():
        at = f"{shown(index.path(key))}:{method.lineno}: {class_name}.{name}"
        overridden = [k for k in later if name in defs[k]]
        if name in decorated and not overridden and not (name.startswith("__") and hasattr(object, name)):
            searched = ", ".join(k.rpartition(".")[2] for k in later) or "no class of the tree"
            problems.append(
                f"{at} is marked @override, but no class after it in the MRO of {hosts} ({searched}) defines {name}:"
                " renamed or removed upstream?"
            )
        elif in_overlay and name not in decorated and overridden:
            target = overridden[0].rpartition(".")[2]
            problems.append(f"{at} overrides {target}.{name} in the MRO of {hosts} but is not marked @override")
    return problems
