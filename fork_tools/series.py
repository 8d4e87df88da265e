"""The patch series: reading it, applying it with ``whatthepatch``, and writing patches back.

Each file in ``patches/`` is a git-style patch: a mail-like header (``From``, ``Subject``), DEP-3 fields
(``Description`` with continuation lines, ``Bug``, ``Forwarded``), a ``---`` line, then unified diffs with ``a/``
and ``b/`` prefixes relative to the upstream repository root. ``patches/series`` lists them in order, by their
path relative to ``patches/`` (``compat/...``, ``upstream/...``, ``fork/...``); that path is the patch's name.

Diffs outside the package: a patch meant for upstream may also carry a ``CHANGELOG.md`` hunk (or any other
repository file), written against upstream's git tree with ordinary context, so that ``python -m fork_tools
export`` can hand it over unchanged. The wheel the fork is built from holds only ``pytorch_lightning/``, so
applying a patch (materialize, check, refresh) skips every diff whose path is not under ``pytorch_lightning/``;
``refresh`` keeps those diffs verbatim when it rewrites a patch (see ``split_diffs``).
"""
import difflib
import re
from pathlib import Path
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

import whatthepatch

from fork_tools.upstream import ROOT, BuildError

PATCH_DIR = ROOT / "patches"
SERIES_FILE = PATCH_DIR / "series"

# A tree in memory: posix path relative to the repository root -> file text.
Tree = Dict[str, str]


PACKAGE_PREFIX = "pytorch_lightning/"


def in_package(path: str) -> bool:
    """Whether a repository path lies in the package the build materialises (others exist only upstream)."""
    return path.startswith(PACKAGE_PREFIX)


class Patch(NamedTuple):
    path: Path
    header: str
    diff: str
    name: str = ""  # the path relative to the patch directory, as ``series`` lists it

    @property
    def subject(self) -> str:
        match = re.search(r"^Subject: (?:\[PATCH[^\]]*\] )?(.*)$", self.header, re.M)
        return match.group(1).strip() if match else self.path.name


def series_names(series_file: Path = SERIES_FILE) -> List[str]:
    names = []
    for line in series_file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def read_patch(path: Path, name: Optional[str] = None) -> Patch:
    text = path.read_text()
    start = re.search(r"^diff --git ", text, re.M)
    if not start:
        raise BuildError(f"{path.name}: no 'diff --git' section found")
    header, diff = text[: start.start()], text[start.start() :]
    for field in ("Subject:",):
        if field not in header:
            raise BuildError(f"{path.name}: header lacks {field!r}")
    return Patch(path, header, diff, name or path.name)


def read_series(patch_dir: Path = PATCH_DIR) -> List[Patch]:
    return [read_patch(patch_dir / name, name) for name in series_names(patch_dir / "series")]


_DIFF_START = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.M)


def split_diffs(diff: str) -> List[Tuple[str, str]]:
    """Split a patch body into ``(path, text)`` per ``diff --git`` section, text kept byte for byte."""
    starts = list(_DIFF_START.finditer(diff))
    if diff.strip() and (not starts or starts[0].start() != 0):
        raise BuildError("patch body must start with a 'diff --git a/<path> b/<path>' line")
    ends = [m.start() for m in starts[1:]] + [len(diff)]
    return [(m.group(2), diff[m.start() : end]) for m, end in zip(starts, ends)]


def _hunk_header(diff_text: str, number: Optional[int]) -> str:
    headers = [ln for ln in diff_text.splitlines() if ln.startswith("@@ ")]
    if number is None or not 1 <= number <= len(headers):
        return ""
    return f" at hunk #{number} '{headers[number - 1]}'"


def _strip_prefix(path: Optional[str]) -> Optional[str]:
    if path is None or path == "/dev/null":
        return None
    return path[2:] if path[:2] in ("a/", "b/") else path


def _split_lines(text: str) -> List[str]:
    return text.splitlines()


def _join_lines(lines: Iterable[str]) -> str:
    lines = list(lines)
    return "\n".join(lines) + "\n" if lines else ""


def apply_patch(tree: Tree, patch: Patch) -> None:
    """Apply one patch to ``tree`` in place; a hunk that does not match raises a BuildError naming it.

    Diffs of files outside ``pytorch_lightning/`` are skipped: they target upstream's repository (see above).
    """
    for diff in whatthepatch.parse_patch(patch.diff):
        old = _strip_prefix(diff.header.old_path)
        new = _strip_prefix(diff.header.new_path)
        target = new or old
        if target is None or not in_package(target):
            continue
        if old is not None and old not in tree:
            raise BuildError(f"patch {patch.name or patch.path.name} does not apply: {old} does not exist in the tree")
        source = tree.get(old, "") if old else ""
        try:
            result = whatthepatch.apply_diff(diff, _split_lines(source))
        except whatthepatch.exceptions.HunkApplyException as err:
            where = _hunk_header(diff.text, getattr(err, "hunk", None))
            raise BuildError(f"patch {patch.name or patch.path.name} does not apply to {target}{where}: {err}") from None
        if new is None:
            tree.pop(old, None)
            continue
        if old is not None and old != new:
            tree.pop(old)
        tree[new] = _join_lines(result)


def apply_series(tree: Tree, patches: Iterable[Patch]) -> None:
    for patch in patches:
        apply_patch(tree, patch)


def unified_diff(before: Tree, after: Tree, context: int = 3) -> str:
    """A git-style diff of two trees, with ordinary context, in path order."""
    chunks = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        lines = difflib.unified_diff(
            (old or "").splitlines(keepends=True),
            (new or "").splitlines(keepends=True),
            fromfile=f"a/{path}" if old is not None else "/dev/null",
            tofile=f"b/{path}" if new is not None else "/dev/null",
            n=context,
        )
        body = "".join(lines)
        if not body:
            continue
        mode = ""
        if old is None:
            mode = "new file mode 100644\n"
        elif new is None:
            mode = "deleted file mode 100644\n"
        chunks.append(f"diff --git a/{path} b/{path}\n{mode}{body}")
    return "".join(chunks)
