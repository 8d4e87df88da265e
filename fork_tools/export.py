"""Export one patch of the series as a ``git am``-ready upstream PR against Lightning's git tag 1.6.5.

The output is a single mail in ``git format-patch`` layout: the patch's ``From``/``Subject`` header, a body made
of its DEP-3 fields, then its diffs exactly as they are (``pytorch_lightning/...`` plus the upstream
``CHANGELOG.md`` hunk it may carry) and every ``--tests`` file as a new-file diff. Paths are upstream's, so
``git am`` works in an upstream checkout. Test files must only import what upstream 1.6.5's test suite offers,
else the PR would not run there; ``check_test_imports`` enforces that. For the same reason neither the patch's added
lines nor the tests may import the fork's overlay modules (``overlay/``): upstream has none of them
(``overlay_imports``).
"""
import ast
import email.utils
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Collection, Dict, Iterable, List, Optional, Sequence

from fork_tools.overlay import OVERLAY_DIR, absolute_import, overlay_modules
from fork_tools.series import PATCH_DIR, Patch, read_series, split_diffs, unified_diff
from fork_tools.upstream import ROOT, BuildError

# Third-party top-level modules an upstream test may import (besides the standard library).
ALLOWED_TOP_LEVEL = {"pytorch_lightning", "torch", "fairscale", "pytest"}
# The helpers upstream 1.6.5's tests/ has, under the same names as ours: module -> names a test may import.
UPSTREAM_HELPERS: Dict[str, set] = {
    "tests.helpers": {"BoringModel", "RandomDataset", "BoringDataModule"},
    "tests.helpers.boring_model": {"BoringModel", "RandomDataset", "BoringDataModule"},
    "tests.helpers.runif": {"RunIf"},
}
# Header fields that become the mail's own headers, not body lines; Forwarded describes the fork, not the PR.
_MAIL_FIELDS = {"from", "subject", "date", "forwarded"}
_DESCRIPTION_FIELDS = {"description", "why"}
_ZERO_FROM = "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001"


def header_fields(header: str) -> List[List[str]]:
    """``[name, value]`` pairs of a patch header (mail headers and DEP-3 fields), continuation lines joined."""
    fields: List[List[str]] = []
    for line in header.splitlines():
        if line.strip() == "---":
            break
        if line[:1] in (" ", "\t") and fields:
            # DEP-3 writes an empty line of a multi-line field as " ."
            fields[-1][1] += "\n" + ("" if line.strip() == "." else line.strip())
            continue
        match = re.match(r"^([A-Za-z][A-Za-z0-9-]*):\s?(.*)$", line)
        if match:
            fields.append([match.group(1), match.group(2).strip()])
    return fields


def _module_of(rel_path: str) -> str:
    return rel_path[: -len(".py")].replace("/", ".").removesuffix(".__init__")


def _resolve(module: Optional[str], level: int, importer: str) -> str:
    """The absolute module name of a (possibly relative) import in module ``importer``."""
    if not level:
        return module or ""
    package = importer.split(".")
    base = package[: len(package) - level]
    return ".".join(base + ([module] if module else []))


def check_test_imports(files: Dict[str, str], fork_modules: Collection[str] = ()) -> List[str]:
    """Imports in ``files`` (repo-relative path -> source) that upstream 1.6.5 could not satisfy, one line each;
    ``fork_modules`` (the overlay's) are refused although they live in ``pytorch_lightning``."""
    included = {_module_of(path) for path in files}
    stdlib = set(sys.stdlib_module_names)

    def allowed(module: str, names: Sequence[str]) -> bool:
        if module in fork_modules or any(f"{module}.{name}" in fork_modules for name in names):
            return False
        top = module.split(".")[0]
        if top in stdlib or top in ALLOWED_TOP_LEVEL or module in included:
            return True
        if module in UPSTREAM_HELPERS:
            return bool(names) and set(names) <= UPSTREAM_HELPERS[module]
        # ``from tests.fork import test_x`` where tests/fork/test_x.py is part of the export.
        return bool(names) and all(f"{module}.{name}" in included for name in names)

    problems = []
    for path, source in files.items():
        try:
            tree = ast.parse(source, filename=path)
        except SyntaxError as err:
            problems.append(f"{path}:{err.lineno}: does not parse: {err.msg}")
            continue
        importer = _module_of(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bad = [alias.name for alias in node.names if not allowed(alias.name, [])]
            elif isinstance(node, ast.ImportFrom):
                module = _resolve(node.module, node.level, importer)
                names = [alias.name for alias in node.names]
                bad = [] if allowed(module, names) else [f"{module} ({', '.join(names)})"]
            else:
                continue
            problems += [f"{path}:{node.lineno}: imports {what}" for what in bad]
    return problems


_FROM_IMPORT = re.compile(r"^\s*from\s+(\.*)([\w.]*)\s+import\s+\(?([^#]*)")
_IMPORT = re.compile(r"^\s*import\s+([^#]+)")


def overlay_imports(patch: Patch, fork_modules: Collection[str]) -> List[str]:
    """Added lines of ``patch`` that import one of ``fork_modules``, as ``path: +line``.

    Lines are read one at a time (an import's continuation lines are not joined), which finds every import
    statement's module and the names on its first line: enough for the hooks a patch adds.
    """
    found = []
    for path, text in split_diffs(patch.diff):
        for line in text.splitlines():
            if not line.startswith("+") or line.startswith("+++"):
                continue
            code = line[1:]
            modules: List[str] = []
            match = _FROM_IMPORT.match(code)
            if match:
                module = absolute_import(path, match.group(2) or None, len(match.group(1)))
                names = [part.split()[0] for part in match.group(3).replace(")", "").split(",") if part.split()]
                modules = [module] + [f"{module}.{name}" for name in names]
            elif _IMPORT.match(code):
                modules = [part.split()[0] for part in _IMPORT.match(code).group(1).split(",") if part.split()]
            if any(module in fork_modules for module in modules):
                found.append(f"{path}: {line}")
    return found


def _test_diffs(tests: Iterable[Path], root: Path) -> Dict[str, str]:
    files: Dict[str, str] = {}
    for test in tests:
        path = (test if test.is_absolute() else Path.cwd() / test).resolve()
        try:
            rel = path.relative_to(root).as_posix()
        except ValueError:
            raise BuildError(f"test file {test} is not inside the repository {root}") from None
        if not path.is_file():
            raise BuildError(f"test file {test} does not exist")
        text = path.read_text()
        if text and not text.endswith("\n"):
            raise BuildError(f"test file {rel} does not end with a newline; add one so the diff is exact")
        files[rel] = text
    return files


def _mail(patch: Patch, diffs: str, date: str) -> str:
    fields = header_fields(patch.header)
    author = next((value for name, value in fields if name.lower() == "from"), None)
    if not author:
        raise BuildError(f"{patch.name}: header lacks 'From:', which git am needs for the author")
    date = next((value for name, value in fields if name.lower() == "date"), date)
    # The description is the commit message proper; the other DEP-3 fields (Bug, Origin ...) become trailers.
    description = "\n".join(value for key, value in fields if key.lower() in _DESCRIPTION_FIELDS)
    trailers = "\n".join(
        f"{key}: {value}" for key, value in fields if key.lower() not in _MAIL_FIELDS | _DESCRIPTION_FIELDS
    )
    body = "\n\n".join(part for part in (description, trailers) if part)
    return (
        f"{_ZERO_FROM}\nFrom: {author}\nDate: {date}\nSubject: [PATCH] {patch.subject}\n"
        "MIME-Version: 1.0\nContent-Type: text/plain; charset=UTF-8\nContent-Transfer-Encoding: 8bit\n\n"
        f"{body}\n---\n{diffs}"
    )


def _now() -> str:
    # SOURCE_DATE_EPOCH makes the output reproducible, as in other build tools.
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    return email.utils.formatdate(float(epoch) if epoch else None, localtime=False)


def git_apply_check(mail: Path, upstream: Path) -> str:
    proc = subprocess.run(
        ["git", "apply", "--check", "-v", str(mail.resolve())],
        cwd=upstream,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if proc.returncode != 0:
        raise BuildError(f"git apply --check of {mail} failed in {upstream}:\n{proc.stdout.strip()}")
    return f"git apply --check: OK in {upstream}"


def export(
    patch: str,
    tests: Sequence[Path],
    output: Path,
    upstream: Optional[Path] = None,
    patch_dir: Path = PATCH_DIR,
    root: Path = ROOT,
    overlay_dir: Path = OVERLAY_DIR,
) -> str:
    """Write the PR mail for ``patch`` (its name in the series, e.g. ``upstream/x.patch``) to ``output``."""
    name = Path(patch).as_posix()
    by_name = {p.name: p for p in read_series(patch_dir)}
    if name not in by_name:
        raise BuildError(f"{name} is not in {patch_dir / 'series'}; choose one of: {', '.join(by_name)}")
    chosen = by_name[name]
    fork_modules = overlay_modules(overlay_dir)
    imports = overlay_imports(chosen, fork_modules)
    if imports:
        raise BuildError(
            f"{name} imports the fork's overlay modules, which upstream does not have (move what it needs into "
            "the patch itself):\n  " + "\n  ".join(imports)
        )

    test_files = _test_diffs([Path(t) for t in tests], root)
    problems = check_test_imports(test_files, fork_modules)
    if problems:
        raise BuildError(
            "test files import what upstream 1.6.5 does not have (allowed: the standard library, "
            f"{', '.join(sorted(ALLOWED_TOP_LEVEL))}, tests.helpers' BoringModel/RandomDataset/BoringDataModule, "
            "tests.helpers.runif.RunIf, and the exported test files themselves):\n  " + "\n  ".join(problems)
        )
    patch_paths = {path for path, _ in split_diffs(chosen.diff)}
    clash = patch_paths & set(test_files)
    if clash:
        raise BuildError(f"{', '.join(sorted(clash))} is both in {name} and given with --tests")

    mail = _mail(chosen, chosen.diff + unified_diff({}, test_files), _now())
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(mail)

    report = [f"wrote {output}: {name} ({len(patch_paths)} file(s)) + {len(test_files)} test file(s)"]
    if "CHANGELOG.md" not in patch_paths:
        report.append(f"note: {name} has no CHANGELOG.md hunk; upstream PRs usually need one")
    if upstream is not None:
        report.append(git_apply_check(output, upstream))
    return "\n".join(report)
