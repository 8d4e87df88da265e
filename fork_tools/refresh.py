"""Check the materialised tree against the series, and refresh edits made in it back into a patch."""
import textwrap
from pathlib import Path
from typing import List, Optional

from fork_tools.revision import bump_revision
from fork_tools.materialize import PACKAGE, fork_version, inputs_digest, pristine_tree, read_tree, write_tree
from fork_tools.series import (
    PATCH_DIR,
    Patch,
    apply_patch,
    apply_series,
    in_package,
    read_series,
    split_diffs,
    unified_diff,
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


def check(root: Path = ROOT, patch_dir: Path = PATCH_DIR) -> List[str]:
    """Differences between ``root/pytorch_lightning`` and upstream + series, one line each."""
    if not (root / PACKAGE).is_dir():
        return [f"{root / PACKAGE} does not exist: run 'python -m fork_tools materialize'"]
    expected = pristine_tree()
    apply_series(expected, read_series(patch_dir))
    actual = read_tree(root)
    problems = []
    for path in sorted(set(expected) | set(actual)):
        if path not in actual:
            problems.append(f"missing: {path}")
        elif path not in expected:
            problems.append(f"not from upstream + series: {path}")
        elif actual[path] != expected[path]:
            problems.append(f"differs: {path}")
    return problems


def _with_kept_diffs(package_diff: str, old: Optional[Patch]) -> str:
    """``package_diff`` plus the diffs outside the package (CHANGELOG.md ...) of the old patch, in path order."""
    sections = split_diffs(package_diff)
    if old is not None:
        sections += [(path, text) for path, text in split_diffs(old.diff) if not in_package(path)]
    return "".join(text for _, text in sorted(sections, key=lambda section: section[0]))


def refresh(
    name: str,
    subject: Optional[str] = None,
    why: Optional[str] = None,
    bug: Optional[str] = None,
    root: Path = ROOT,
    patch_dir: Path = PATCH_DIR,
) -> str:
    """Record the edits in ``root``'s tree into patch ``name`` and rewrite the tree from the updated series.

    For a patch already in the series, the edits (tree minus upstream + whole series) are re-applied on top of the
    series up to that patch, so later patches need not be popped first; they must still apply afterwards. Diffs of
    the old patch outside ``pytorch_lightning/`` (its upstream CHANGELOG.md hunk) are kept as they were.
    """
    series = read_series(patch_dir)
    names = [p.name for p in series]
    disk = read_tree(root)
    pristine = pristine_tree()
    old: Optional[Patch] = None

    if name in names:
        index = names.index(name)
        old = series[index]
        full = dict(pristine)
        apply_series(full, series)
        edits = unified_diff(full, disk)
        if not edits:
            raise BuildError(f"no edits in {PACKAGE}/ relative to upstream + series; {name} unchanged")
        base = dict(pristine)
        apply_series(base, series[:index])
        target = dict(base)
        apply_patch(target, old)
        try:
            apply_patch(target, Patch(old.path, "", edits, old.name))
        except BuildError as err:
            raise BuildError(f"the edits overlap a later patch; refresh that one instead ({err})") from None
        header = old.header
    else:
        if not subject or not why:
            raise BuildError(f"{name} is a new patch: give --subject and --why (and --bug for the upstream link)")
        base = dict(pristine)
        apply_series(base, series)
        target = disk
        header = NEW_HEADER.format(subject=subject, description=description_field(why), bug=bug or "no")

    diff = unified_diff(base, target)
    if not diff:
        raise BuildError(f"{name} would be empty")
    path = patch_dir / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + _with_kept_diffs(diff, old))
    if name not in names:
        with open(patch_dir / "series", "a") as f:
            f.write(name + "\n")

    # Rebuild the tree from the new series; this also proves every later patch still applies.
    series = read_series(patch_dir)
    tree = dict(pristine)
    apply_series(tree, series)
    pin = read_pin()
    revision = bump_revision(patch_dir)
    write_tree(tree, root, fork_version(pin, patch_dir), inputs_digest(pin, series, patch_dir))
    return f"refreshed {path} (fork revision {revision})"
