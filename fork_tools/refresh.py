"""Check the materialised tree against the series, and refresh edits made in it back into a patch."""
from pathlib import Path
from typing import List, Optional

from fork_tools.materialize import inputs_digest, pristine_tree, read_tree, write_tree, fork_version
from fork_tools.series import PATCH_DIR, SERIES_FILE, Patch, apply_patch, apply_series, read_series, unified_diff
from fork_tools.upstream import ROOT, BuildError, read_pin

NEW_HEADER = """From: pytorch-lightning fsdp fork <fork@users.noreply.github.com>
Subject: [PATCH] {subject}

Description: {why}
Bug: {bug}
Forwarded: no
---
"""


def check(root: Path = ROOT) -> List[str]:
    """Differences between ``root/pytorch_lightning`` and upstream + series, one line each."""
    if not (root / "pytorch_lightning").is_dir():
        return [f"{root / 'pytorch_lightning'} does not exist: run 'python -m fork_tools materialize'"]
    expected = pristine_tree()
    apply_series(expected, read_series())
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


def refresh(name: str, subject: Optional[str] = None, why: Optional[str] = None, bug: Optional[str] = None) -> str:
    """Record the edits in the tree into patch ``name`` and rewrite the tree from the updated series.

    For a patch already in the series, the edits (tree minus upstream + whole series) are re-applied on top of the
    series up to that patch, so later patches need not be popped first; they must still apply afterwards.
    """
    series = read_series()
    names = [p.path.name for p in series]
    disk = read_tree(ROOT)
    pristine = pristine_tree()

    if name in names:
        index = names.index(name)
        old = series[index]
        full = dict(pristine)
        apply_series(full, series)
        edits = unified_diff(full, disk)
        if not edits:
            raise BuildError(f"no edits in pytorch_lightning/ relative to upstream + series; {name} unchanged")
        base = dict(pristine)
        apply_series(base, series[:index])
        target = dict(base)
        apply_patch(target, old)
        try:
            apply_patch(target, Patch(old.path, "", edits))
        except BuildError as err:
            raise BuildError(f"the edits overlap a later patch; refresh that one instead ({err})") from None
        header = old.header
    else:
        if not subject or not why:
            raise BuildError(f"{name} is a new patch: give --subject and --why (and --bug for the upstream link)")
        index = len(series)
        base = dict(pristine)
        apply_series(base, series)
        target = disk
        header = NEW_HEADER.format(subject=subject, why=why, bug=bug or "none")

    diff = unified_diff(base, target)
    if not diff:
        raise BuildError(f"{name} would be empty")
    path = PATCH_DIR / name
    path.write_text(header + diff)
    if name not in names:
        with open(SERIES_FILE, "a") as f:
            f.write(name + "\n")

    # Rebuild the tree from the new series; this also proves every later patch still applies.
    series = read_series()
    tree = dict(pristine)
    apply_series(tree, series)
    pin = read_pin()
    write_tree(tree, ROOT, fork_version(pin, series), inputs_digest(pin, series))
    return f"refreshed {path.relative_to(ROOT)}"
