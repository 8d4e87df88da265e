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

Hunks are applied by exact context, never by line number and never with fuzz: a hunk's old lines (context and
removed lines) must occur exactly once in the file, and it is applied there. A stale line number in a hunk header
(an earlier patch grew or shrank) therefore does not break a build, while a hunk that could land in two places, or
in none, always does. ``refresh`` rewrites the line numbers of the patches it relocated (see ``exact_diff``).
"""
import difflib
import re
from pathlib import Path
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

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


def _strip_prefix(path: Optional[str]) -> Optional[str]:
    if path is None or path == "/dev/null":
        return None
    return path[2:] if path[:2] in ("a/", "b/") else path


def _split_lines(text: str) -> List[str]:
    return text.splitlines()


def _join_lines(lines: Iterable[str]) -> str:
    lines = list(lines)
    return "\n".join(lines) + "\n" if lines else ""


class Hunk(NamedTuple):
    number: int  # 1-based, within its file's diff
    header: str  # the ``@@ ... @@`` line
    start: int  # the old start line the header claims (1-based; 0 for an insertion into an empty file)
    old: List[str]  # context and removed lines, in order
    new: List[str]  # context and added lines, in order


_HUNK_START = re.compile(r"^@@ -(\d+)")


def _hunks(diff) -> List[Hunk]:
    headers = [ln for ln in diff.text.splitlines() if ln.startswith("@@ ")]
    lines: Dict[int, Tuple[List[str], List[str]]] = {n: ([], []) for n in range(1, len(headers) + 1)}
    for change in diff.changes or []:
        old, new = lines.setdefault(change.hunk, ([], []))
        if change.old is not None:
            old.append(change.line)
        if change.new is not None:
            new.append(change.line)
    hunks = []
    for number, (old, new) in sorted(lines.items()):
        header = headers[number - 1] if number <= len(headers) else ""
        match = _HUNK_START.match(header)
        hunks.append(Hunk(number, header, int(match.group(1)) if match else 0, old, new))
    return hunks


def _occurrences(lines: List[str], needle: List[str]) -> List[int]:
    """Every index at which ``needle`` occurs in ``lines`` as a contiguous run."""
    if not needle:
        # Only an insertion into an empty file has no old lines to anchor it; elsewhere it could go anywhere.
        return [0] if not lines else list(range(len(lines) + 1))
    n, first = len(needle), needle[0]
    return [i for i in range(len(lines) - n + 1) if lines[i] == first and lines[i : i + n] == needle]


def locate_hunks(source: List[str], hunks: List[Hunk], where: str) -> Tuple[List[int], List[str]]:
    """Where each of ``hunks`` applies to ``source``, by exact context: the offset of each from the line its header
    claims, and a line for each hunk that moved.

    Each hunk's old lines are searched in the whole file; they must occur exactly once, and hunks must stay in
    order without overlapping. A hunk that moved is one found elsewhere than its header says (e.g. an earlier
    patch changed the line count above it); it still applies, and refresh rewrites its header.
    """
    offsets: List[int] = []
    moved: List[str] = []
    done = 0
    for hunk in hunks:
        at = f"{where} at hunk #{hunk.number} '{hunk.header}'"
        found = _occurrences(source, hunk.old)
        if len(found) != 1:
            what = "are not in the file" if not found else f"occur {len(found)} times in the file"
            raise BuildError(f"{at}: its context and removed lines {what}; they must occur exactly once")
        index = found[0]
        if index < done:
            raise BuildError(f"{at}: it overlaps or precedes the hunk before it")
        offsets.append(index - max(hunk.start - 1, 0))
        if offsets[-1]:
            moved.append(f"{at}: old lines found at line {index + 1}")
        done = index + len(hunk.old)
    return offsets, moved


def _shifted(diff: Any, offsets: List[int]) -> Any:
    """``diff`` (whatthepatch's) with each hunk's old and new line numbers moved by its offset: an offset moves
    both sides alike, since the lines above the hunk grew or shrank in the file it is applied to."""
    by_hunk = dict(enumerate(offsets, start=1))

    def shift(number: Optional[int], hunk: int) -> Optional[int]:
        return None if number is None else number + by_hunk.get(hunk, 0)

    changes = [
        change._replace(old=shift(change.old, change.hunk), new=shift(change.new, change.hunk))
        for change in diff.changes or []
    ]
    return diff._replace(changes=changes)


def apply_patch(tree: Tree, patch: Patch) -> List[str]:
    """Apply one patch to ``tree`` in place, each hunk by exact context (``locate_hunks``); returns the hunks that
    were found away from their header's line (empty when the patch's line numbers are exact).

    A hunk that does not match raises a BuildError naming patch, file and hunk. Diffs of files outside
    ``pytorch_lightning/`` are skipped: they target upstream's repository (see above).
    """
    moved: List[str] = []
    label = patch.name or patch.path.name
    for diff in whatthepatch.parse_patch(patch.diff):
        old = _strip_prefix(diff.header.old_path)
        new = _strip_prefix(diff.header.new_path)
        # whatthepatch names both sides after the ``diff --git`` line; a created or deleted file says so below it.
        if re.search(r"^(new file mode|--- /dev/null$)", diff.text, re.M):
            old = None
        if re.search(r"^(deleted file mode|\+\+\+ /dev/null$)", diff.text, re.M):
            new = None
        target = new or old
        if target is None or not in_package(target):
            continue
        if old is not None and old not in tree:
            raise BuildError(f"patch {label} does not apply: {old} does not exist in the tree")
        if old is None and new in tree:
            raise BuildError(f"patch {label} does not apply: it creates {new}, which already exists")
        source = tree.get(old, "") if old else ""
        where = f"patch {label} does not apply to {target}"
        lines = _split_lines(source)
        offsets, relocated = locate_hunks(lines, _hunks(diff), where)
        moved += relocated
        try:
            # whatthepatch applies the hunks where ``locate_hunks`` found them, and checks every line again
            result = whatthepatch.apply_diff(_shifted(diff, offsets), lines)
        except whatthepatch.exceptions.HunkApplyException as err:
            raise BuildError(f"{where}: {err}") from None
        if new is None:
            tree.pop(old, None)
            continue
        if old is not None and old != new:
            tree.pop(old)
        tree[new] = _join_lines(result)
    return moved


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


def exact_diff(before: Tree, after: Tree) -> str:
    """``unified_diff`` whose every hunk applies to ``before`` by unique exact context (see ``locate_hunks``).

    Per file the context grows from 3 lines until each hunk's old lines occur once; in the end a single hunk
    spans the whole file, which always does. ``refresh`` writes patches with it so the next build cannot fail on
    a hunk that it generated.
    """
    chunks = []
    for path in sorted(set(before) | set(after)):
        one_before = {path: before[path]} if path in before else {}
        one_after = {path: after[path]} if path in after else {}
        if one_before == one_after:
            continue
        lines = max(len(before.get(path, "").splitlines()), len(after.get(path, "").splitlines()))
        for context in (3, 6, 12, 24, 48, lines):
            text = unified_diff(one_before, one_after, context)
            trial = dict(one_before)
            try:
                apply_patch(trial, Patch(Path(path), "", text, path))
            except BuildError:
                continue
            if trial == one_after or not in_package(path):
                break
        chunks.append(text)
    return "".join(chunks)
