"""Check the materialised tree against the series and the overlay, and refresh edits made in it back into them.

Edits to overlay modules go back to their files under ``overlay/``; every other edit goes into a patch. When that
patch changes line counts, the later patches are re-applied by exact context (``series.locate_hunks``) and those
that moved are rewritten with their new line numbers, so the series never keeps a stale header.
"""
import textwrap
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from fork_tools.materialize import (
    PACKAGE,
    fork_version,
    inputs_digest,
    pristine_tree,
    read_stamp,
    read_tree,
    write_tree,
)
from fork_tools.overrides import override_problems
from fork_tools.overlay import OVERLAY_DIR, apply_overlay, features, for_series, overlay_problems, read_overlay
from fork_tools.revision import bump_revision
from fork_tools.series import (
    PATCH_DIR,
    Patch,
    Tree,
    apply_patch,
    apply_series,
    exact_diff,
    in_package,
    read_series,
    split_diffs,
)
from fork_tools.upstream import ROOT, BuildError, read_pin

NEW_HEADER = """From: pytorch-lightning fsdp fork <fork@users.noreply.github.com>
Subject: [PATCH] {subject}

{description}
Bug: {bug}
Forwarded: no
---
"""


def description_field(text: str, width: int = 72) -> str:
    """A DEP-3 ``Description`` field: wrapped, continuation lines indented, paragraphs separated by `` .``."""
    lines: List[str] = []
    for number, paragraph in enumerate(p for p in text.strip().split("\n\n") if p.strip()):
        if number:
            lines.append(" .")
        first = "Description: " if number == 0 else " "
        lines += textwrap.wrap(" ".join(paragraph.split()), width, initial_indent=first, subsequent_indent=" ")
    return "\n".join(lines)


def check(root: Path = ROOT, patch_dir: Path = PATCH_DIR, overlay_dir: Path = OVERLAY_DIR) -> List[str]:
    """Problems of ``root/pytorch_lightning``, one line each: overlay modules that break the overlay's rules
    (``overlay.overlay_problems``: shadowing, no feature line), differences from upstream + series + overlay, and
    overrides without a target found by reading the tree (``overrides.override_problems``: ``@override`` methods
    overriding nothing, overlay methods overriding one without ``@override``). A hook's other targets are checked
    by building the expected tree, which applies every patch by exact context."""
    if not (root / PACKAGE).is_dir():
        return [f"{root / PACKAGE} does not exist: run 'python -m fork_tools materialize'"]
    series = read_series(patch_dir)
    expected = pristine_tree()
    apply_series(expected, series)
    overlay = for_series(read_overlay(overlay_dir), [p.name for p in series], patch_dir)
    problems = overlay_problems(overlay, expected, [p.name for p in series], overlay_dir)
    modules = {path for path in overlay if path not in expected}  # a shadowing file is upstream's, not a module
    expected.update({path: overlay[path] for path in modules})
    actual = read_tree(root)
    for path in sorted(set(expected) | set(actual)):
        if path not in actual:
            problems.append(f"missing: {path}")
        elif path not in expected:
            problems.append(f"not from upstream + series: {path}")
        elif actual[path] != expected[path]:
            problems.append(f"differs: {path}")
    shown = lambda path: f"{overlay_dir.name}/{path}" if path in modules else path  # noqa: E731
    return problems + override_problems(actual, modules & set(actual), shown)


def _with_kept_diffs(package_diff: str, old: Optional[Patch]) -> str:
    """``package_diff`` plus the diffs outside the package (CHANGELOG.md ...) of the old patch, in path order."""
    sections = split_diffs(package_diff)
    if old is not None:
        sections += [(path, text) for path, text in split_diffs(old.diff) if not in_package(path)]
    return "".join(text for _, text in sorted(sections, key=lambda section: section[0]))


def _module_edits(disk: Tree, overlay: Tree, built: Tree) -> Dict[str, Optional[str]]:
    """Overlay files to write (path -> text) or delete (None): overlay modules edited or removed in the tree, and
    new files there that name their feature (``# fork-feature:``), which are overlay modules by the rules."""
    edits: Dict[str, Optional[str]] = {p: disk.get(p) for p in overlay if disk.get(p) != overlay[p]}
    for path, text in disk.items():
        if path not in overlay and path not in built and path.endswith(".py") and features(text):
            edits[path] = text
    return edits


def _refresh_patch(
    series: List[Patch], name: str, edits: str, pristine: Tree, package: Tree, header: str
) -> Tuple[List[Patch], List[str]]:
    """The series with ``edits`` (a diff against upstream + series) recorded in patch ``name`` (appended if new),
    and the names of the patches rewritten: ``name`` and every later patch whose hunks moved."""
    names = [p.name for p in series]
    index = names.index(name) if name in names else len(series)
    old = series[index] if name in names else None
    base = dict(pristine)
    apply_series(base, series[:index])
    if old is None:
        target = dict(package)
    else:
        target = dict(base)
        apply_patch(target, old)
        try:
            apply_patch(target, Patch(old.path, "", edits, "(your edits)"))
        except BuildError as err:
            raise BuildError(
                f"the edits do not apply to the series up to {name} by exact context; if they overlap a later patch, "
                f"refresh that one instead ({err})"
            ) from None
    diff = exact_diff(base, target)
    if not diff:
        raise BuildError(f"{name} would be empty")
    result = series[:index] + [Patch(old.path if old else Path(name), header, _with_kept_diffs(diff, old), name)]
    changed = [name]
    tree = target
    for later in series[index + 1 :]:
        before = dict(tree)
        if apply_patch(tree, later):  # applied by exact context, away from its line numbers: rewrite them
            later = later._replace(diff=_with_kept_diffs(exact_diff(before, tree), later))
            changed.append(later.name)
        result.append(later)
    return result, changed


def refuse_a_stale_tree(root: Path, series: List[Patch], overlay: Tree, patch_dir: Path, overlay_dir: Path) -> None:
    """Raise unless ``root``'s build stamp says it was built from ``series`` and ``overlay`` as they are now.

    A tree built from other inputs (a ``materialize`` that failed left the previous build in place, or patches or
    overlay modules changed since) differs from the inputs in ways that are not edits: refresh would write its old
    modules back to ``overlay_dir``, delete new ones, and record the old series as edits."""
    stamp = read_stamp(root)
    built_for = inputs_digest(read_pin(), series, patch_dir, for_series(overlay, [p.name for p in series], patch_dir))
    if stamp is not None and stamp.get("inputs") == built_for:
        return
    state = f"was built from other inputs than {patch_dir.name}/ and {overlay_dir.name}/ hold now"
    if stamp is None:
        state = "has no build stamp"
    raise BuildError(
        f"{root / PACKAGE} {state} (the last materialize failed, or they changed since), so its differences from "
        f"them are not all edits; refresh changed nothing. Fix the inputs and run 'python -m fork_tools materialize'"
        " first; if the tree holds edits to keep, copy them out, run 'materialize --force' and make them again."
    )


def _refuse_overlay_shadowing(overlay: Tree, full: Tree, overlay_dir: Path) -> None:
    shadowing = sorted(set(overlay) & set(full))
    if shadowing:  # the tree holds upstream's file there, which must not be taken for the module (or dropped)
        raise BuildError(f"{overlay_dir.name}/ shadows files of upstream + series ({', '.join(shadowing)}); move them")


def _patch_header(
    series: List[Patch], name: str, subject: Optional[str], why: Optional[str], bug: Optional[str]
) -> str:
    """The header of patch ``name``: its own if it is in ``series``, else a new one from ``subject`` and ``why``."""
    names = [p.name for p in series]
    if name in names:
        return series[names.index(name)].header
    if not subject or not why:
        raise BuildError(f"{name} is a new patch: give --subject and --why (and --bug for the upstream link)")
    return NEW_HEADER.format(subject=subject, description=description_field(why), bug=bug or "no")


def _series_with_edits(
    series: List[Patch], name: Optional[str], edits: str, pristine: Tree, package: Tree, header: str
) -> Tuple[List[Patch], List[str]]:
    """The series with the package ``edits`` recorded in patch ``name``, and the names of the patches rewritten
    (none without edits)."""
    if edits:
        if name is None:
            files = ", ".join(path for path, _ in split_diffs(edits))
            raise BuildError(f"edits in {files} belong in a patch: name it ('refresh fork/<slug>.patch')")
        return _refresh_patch(series, name, edits, pristine, package, header)
    if name is not None and name not in [p.name for p in series]:
        raise BuildError(f"{name} would be empty")
    return series, []


def _refuse_a_different_rebuild(tree: Tree, disk: Tree) -> None:
    if tree != disk:
        wrong = sorted(p for p in set(tree) | set(disk) if tree.get(p) != disk.get(p))
        raise BuildError(
            f"the refreshed series would not rebuild the edited tree ({', '.join(wrong)}); if the edits overlap a "
            "later patch, refresh that one instead"
        )


def _write_refreshed_inputs(
    series: List[Patch],
    changed: List[str],
    appended: Optional[str],
    modules: Dict[str, Optional[str]],
    patch_dir: Path,
    overlay_dir: Path,
) -> None:
    """Write the ``changed`` patches, append ``appended`` to the series file, and write or delete the overlay
    ``modules``."""
    for patch in series:
        if patch.name in changed:
            (patch_dir / patch.name).parent.mkdir(parents=True, exist_ok=True)
            (patch_dir / patch.name).write_text(patch.header + patch.diff)
    if appended is not None:
        with open(patch_dir / "series", "a") as f:
            f.write(appended + "\n")
    for path, text in modules.items():
        target = overlay_dir / path
        if text is None:
            target.unlink()
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)


def refresh(
    name: Optional[str] = None,
    subject: Optional[str] = None,
    why: Optional[str] = None,
    bug: Optional[str] = None,
    root: Path = ROOT,
    patch_dir: Path = PATCH_DIR,
    overlay_dir: Path = OVERLAY_DIR,
) -> str:
    """Record the edits in ``root``'s tree, bump the revision and rewrite the tree from the updated inputs.

    Edits to overlay modules (and new modules with a ``# fork-feature:`` line) are written to ``overlay_dir``;
    they need no patch name. Any other edit goes into patch ``name``: for a patch already in the series, the edits
    (tree minus upstream + whole series) are re-applied on top of the series up to that patch, so later patches
    need not be popped first; each later patch is then re-applied by exact context and rewritten with corrected
    line numbers if it moved. Diffs outside ``pytorch_lightning/`` (an upstream CHANGELOG.md hunk) are kept as
    they were. Nothing is written unless the tree was built from the current inputs (its build stamp says so) and
    the rebuilt tree equals the edited one.
    """
    if not (root / PACKAGE).is_dir():
        raise BuildError(f"{root / PACKAGE} does not exist: run 'python -m fork_tools materialize' and edit it")
    series, overlay = read_series(patch_dir), read_overlay(overlay_dir)
    refuse_a_stale_tree(root, series, overlay, patch_dir, overlay_dir)
    names, disk, pristine = [p.name for p in series], read_tree(root), pristine_tree()
    full = dict(pristine)
    apply_series(full, series)
    _refuse_overlay_shadowing(overlay, full, overlay_dir)
    modules = _module_edits(disk, overlay, full)
    new_overlay = {p: t for p, t in {**overlay, **modules}.items() if t is not None}
    package = {p: t for p, t in disk.items() if p not in overlay and p not in modules}
    edits = exact_diff(full, package)
    header = _patch_header(series, name, subject, why, bug) if edits and name else ""
    series, changed = _series_with_edits(series, name, edits, pristine, package, header)
    if not changed and not modules:
        raise BuildError(f"no edits in {PACKAGE}/ relative to upstream + series + overlay; nothing to refresh")
    # Rebuild from the new inputs in memory; nothing is written unless that gives back the edited tree.
    tree = dict(pristine)
    apply_series(tree, series)
    apply_overlay(tree, new_overlay, [p.name for p in series], overlay_dir)
    _refuse_a_different_rebuild(tree, disk)
    appended = name if changed and name not in names else None
    _write_refreshed_inputs(series, changed, appended, modules, patch_dir, overlay_dir)
    series, pin = read_series(patch_dir), read_pin()
    revision = bump_revision(patch_dir, overlay_dir)
    write_tree(tree, root, fork_version(pin, patch_dir), inputs_digest(pin, series, patch_dir, new_overlay))
    what = [f"{patch_dir.name}/{n}" for n in changed] + [f"{overlay_dir.name}/{p}" for p in sorted(modules)]
    return f"refreshed {', '.join(what)} (fork revision {revision})"
