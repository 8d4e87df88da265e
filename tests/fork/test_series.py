"""The series reads as the fork's table of contents: logical patches in their final state, DEP-3 headers."""
import difflib
import re
from typing import Dict, List, Tuple

import pytest

from fork_tools.export import header_fields
from fork_tools.materialize import patched_tree, pristine_tree
from fork_tools.revision import stale_revision
from fork_tools.series import apply_patch, read_series

GROUPS = ("compat/", "upstream/", "fork/")
SERIES = read_series()


def test_every_patch_belongs_to_a_group_in_order():
    groups = [next((g for g in GROUPS if p.name.startswith(g)), None) for p in SERIES]
    assert None not in groups, [p.name for p, g in zip(SERIES, groups) if g is None]
    # compat first (it makes 1.6.5 run at all), then the upstream PR, then fork-only features
    assert groups == sorted(groups, key=GROUPS.index)


@pytest.mark.parametrize("patch", SERIES, ids=[p.name for p in SERIES])
def test_dep3_header(patch):
    fields = {name.lower(): value for name, value in header_fields(patch.header)}
    assert len(patch.subject) <= 72, "Subject must be short"
    assert fields.get("description"), "a Description field says why the patch exists"
    header_lines = patch.header.split("\n---\n")[0].splitlines()
    assert max(len(line) for line in header_lines) <= 80, "wrap the header at 80 columns"
    for name in ("bug", "forwarded"):
        value = fields.get(name, "no")
        assert value == "no" or re.fullmatch(r"https://\S+", value), f"{name}: a URL or 'no', not prose: {value!r}"
    # patches are referred to by slug; a number would go stale whenever the series is reordered or squashed
    assert not re.search(r"\b(patch|patches) ?#?\d{3,4}\b", patch.header, re.I)
    assert not re.search(r"\b\d{4}-[a-z]", patch.header)


def _provenance_steps() -> List[Tuple[str, str, str]]:
    """(patch, group of the line's author, file) for every line a patch changes that a patch before it added."""
    tree = pristine_tree()
    origin: Dict[str, List[str]] = {path: [""] * len(text.splitlines()) for path, text in tree.items()}
    rewrites = []
    for patch in SERIES:
        before = dict(tree)
        apply_patch(tree, patch)
        for path in sorted(set(before) | set(tree)):
            old, new = before.get(path, "").splitlines(), tree.get(path, "").splitlines()
            if old == new:
                continue
            authors = origin.get(path, [""] * len(old))
            updated: List[str] = []
            for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
                if tag == "equal":
                    updated += authors[i1:i2]
                    continue
                # Import statements are shared: two features that import from one module list their names in one
                # statement, so the later patch must edit it. Any other line belongs to the feature that added it.
                rewrites += [
                    (patch.name, author, path)
                    for author, line in zip(authors[i1:i2], old[i1:i2])
                    if author and not line.startswith(("from ", "import "))
                ]
                updated += [patch.name] * (j2 - j1)
            origin[path] = updated
    return rewrites


def test_no_patch_rewrites_lines_an_earlier_patch_of_its_group_added():
    """A patch is a feature in its final state: a later patch of the same group never edits an earlier one's
    lines (refresh that patch instead), import statements aside. Building on another group's lines on purpose
    is allowed."""
    group = lambda name: name.split("/", 1)[0]  # noqa: E731
    same_group = [(p, a, f) for p, a, f in _provenance_steps() if group(p) == group(a) and p != a]
    assert same_group == []


def test_revision_was_bumped_for_this_series():
    assert not stale_revision(), "the series changed: run 'python -m fork_tools bump'"


def _added_lines(diff: str) -> int:
    return sum(1 for line in diff.splitlines() if line.startswith("+") and not re.match(r"\+\+\+ (b/|/dev/null)", line))


def test_fork_patches_are_touch_points_only():
    """A fork feature's code lives in its overlay/ module; its fork/ patch only hooks it in (imports, call sites,
    base classes), so the patches, and the upstream file they touch most, stay small."""
    added = {p.name: _added_lines(p.diff) for p in SERIES if p.name.startswith("fork/")}
    assert {name: n for name, n in added.items() if n > 60} == {}, "at most 60 added lines per fork/ patch"
    assert sum(added.values()) <= 250, f"at most 250 added lines in all fork/ patches: {added}"
    fully_sharded = patched_tree()["pytorch_lightning/strategies/fully_sharded.py"]
    assert len(fully_sharded.splitlines()) <= 450
