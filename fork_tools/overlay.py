"""The overlay: the fork's own modules, kept as whole files under ``overlay/`` at their package paths.

A feature's code lives in ``overlay/pytorch_lightning/...`` (one module per feature), and its ``fork/`` patch
only touches upstream files where the feature hooks in (imports, call sites, mixin base classes). Keeping our code
out of the diffs means a refresh never has to re-diff it, and an upstream change near a hook cannot garble it.

Rules, enforced by ``materialize`` (a BuildError) and ``check`` (one line each):

- an overlay module is a new file: it never replaces an upstream file or one a patch creates;
- it names its feature with a line ``# fork-feature: fork/<slug>.patch`` in its head (the comments before its first
  statement after the docstring), naming a ``fork/`` patch of the series;
- only Python modules under ``pytorch_lightning/``: MANIFEST.in ships ``overlay/**/*.py`` and nothing else, so any
  other file would be missing from an sdist build.

A module belongs to its feature: a build whose series lacks the feature's patch (``groups=("compat",)``, or a
``patches/series`` cut down to some patches, as upstream's test oracle builds compat-only) contains none of its
modules. A module naming a patch that does not exist at all is an error.
"""
import ast
import re
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set

from fork_tools.series import PACKAGE_PREFIX, Tree, in_package
from fork_tools.upstream import ROOT, BuildError

OVERLAY_DIR = ROOT / "overlay"
FORK_GROUP = "fork"
FEATURE_LINE = re.compile(r"^# fork-feature: (?P<name>\S+)\s*$")


def overlay_files(overlay_dir: Path = OVERLAY_DIR) -> Dict[str, Path]:
    """Tree path (``pytorch_lightning/...``) -> file, for every file under ``overlay_dir`` except bytecode."""
    if not overlay_dir.is_dir():
        return {}
    return {
        path.relative_to(overlay_dir).as_posix(): path
        for path in sorted(overlay_dir.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo")
    }


def read_overlay(overlay_dir: Path = OVERLAY_DIR) -> Tree:
    """The overlay as a tree (tree path -> text); anything but a Python module under the package is refused."""
    tree: Tree = {}
    for rel, path in overlay_files(overlay_dir).items():
        if not in_package(rel) or not rel.endswith(".py"):
            raise BuildError(
                f"{overlay_dir.name}/{rel}: the overlay holds Python modules under {PACKAGE_PREFIX} only "
                "(MANIFEST.in ships overlay/**/*.py, so other files would be missing from an sdist build)"
            )
        tree[rel] = path.read_text()
    return tree


def module_name(path: str) -> str:
    """``pytorch_lightning/a/b.py`` -> ``pytorch_lightning.a.b``; a package's ``__init__.py`` is the package."""
    return path[: -len(".py")].replace("/", ".").removesuffix(".__init__")


def absolute_import(importer: str, module: Optional[str], level: int) -> str:
    """The module a (possibly relative) import in tree file ``importer`` names."""
    if not level:
        return module or ""
    package = module_name(importer).split(".")
    if not importer.endswith("/__init__.py"):
        package = package[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def overlay_modules(overlay_dir: Path = OVERLAY_DIR) -> Set[str]:
    """Dotted names of the modules (and packages) the overlay provides."""
    return {module_name(rel) for rel in overlay_files(overlay_dir) if rel.endswith(".py")}


def features(text: str) -> List[str]:
    """The patch names of the ``# fork-feature:`` lines in a module's head (all lines if it does not parse)."""
    lines = text.splitlines()
    try:
        body = ast.parse(text).body
    except SyntaxError:
        body = []
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # the docstring may come first
    head = lines[: body[0].lineno - 1] if body else lines
    return [m.group("name") for m in map(FEATURE_LINE.match, head) if m]


def for_series(overlay: Tree, series: Iterable[str], patch_dir: Optional[Path] = None) -> Tree:
    """The modules of ``overlay`` that a build of ``series`` (patch names) contains: all but those whose feature is
    an existing ``fork/`` patch in ``patch_dir`` that ``series`` leaves out. Modules without a valid feature line
    stay, so that the build reports them."""
    built = set(series)
    kept: Tree = {}
    for rel, text in overlay.items():
        names = features(text)
        left_out = len(names) == 1 and names[0] not in built and names[0].split("/", 1)[0] == FORK_GROUP
        if not (left_out and patch_dir is not None and (patch_dir / names[0]).is_file()):
            kept[rel] = text
    return kept


def overlay_problems(overlay: Tree, tree: Tree, series: Iterable[str], overlay_dir: Path = OVERLAY_DIR) -> List[str]:
    """What is wrong with ``overlay`` on top of ``tree`` (upstream + series), one line each."""
    fork_patches = {name for name in series if name.split("/", 1)[0] == FORK_GROUP}
    problems = []
    for rel, text in sorted(overlay.items()):
        shown = f"{overlay_dir.name}/{rel}"
        if rel in tree:
            problems.append(f"{shown} shadows {rel}, which upstream or a patch provides; overlay modules are new files")
        try:
            ast.parse(text, filename=shown)
        except SyntaxError as err:
            problems.append(f"{shown}:{err.lineno}: does not parse: {err.msg}")
            continue
        names = features(text)
        if len(names) != 1:
            problems.append(
                f"{shown}: needs exactly one '# fork-feature: fork/<slug>.patch' line before its code, has {len(names)}"
            )
        elif names[0] not in fork_patches:
            problems.append(f"{shown}: '# fork-feature: {names[0]}' names no {FORK_GROUP}/ patch of the series")
    return problems


def apply_overlay(tree: Tree, overlay: Tree, series: Iterable[str], overlay_dir: Path = OVERLAY_DIR) -> None:
    """Add the overlay modules to ``tree`` in place, or raise a BuildError listing every problem."""
    problems = overlay_problems(overlay, tree, series, overlay_dir)
    if problems:
        raise BuildError("the overlay does not fit the series:\n  " + "\n  ".join(problems))
    tree.update(overlay)
