"""The upstream PR as upstream would receive it: an upstream-like checkout of 1.6.5 with the exported mail applied.

:func:`build_checkout` makes a git repository from the pristine wheel's ``pytorch_lightning/``, the head of
upstream's ``CHANGELOG.md`` and the test helpers upstream 1.6.5 has (``BoringModel``, ``RunIf``), checks that the
exported mail applies there (``git apply --check``), adds the ``compat/`` patches (1.6.5 does not run on today's
stack without them), applies the mail with ``git apply``, and checks that the package equals the PR-only variant
that ``fork_tools`` builds (compat + upstream patches, no ``fork/`` ones). Finally it copies in what the exported
test file's 2-CPU-rank run needs from this repository: the CPU FSDP harness and the module that drives it.
"""
import os
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List

from fork_tools.materialize import patched_tree, pristine_tree
from fork_tools.series import read_series
from fork_tools.upstream import ROOT

PATCH = "upstream/fsdp-state-dict-on-rank-0-only.patch"
TEST_FILE = "tests/strategies/test_ddp_fully_sharded_state_dict_on_rank_0_only.py"
CPU_TEST_FILE = "tests/strategies/test_ddp_fully_sharded_state_dict_on_rank_0_only_cpu.py"

# Lines 1-10 of upstream's CHANGELOG.md at tag 1.6.5 (Lightning-AI/pytorch-lightning@ff5361604b2f), enough for the
# patch's hunk and its context; the wheel has no CHANGELOG and the fork keeps no copy of upstream's.
UPSTREAM_CHANGELOG_HEAD = """# Changelog

All notable changes to this project will be documented in this file.

The format is based on [Keep a Changelog](http://keepachangelog.com/en/1.0.0/).


## [1.6.5] - 2022-07-12

### Fixed
"""

# Files of ours that upstream 1.6.5 has under the same names and with what the exported tests use from them.
UPSTREAM_HELPERS = [
    "tests/__init__.py",
    "tests/helpers/__init__.py",
    "tests/helpers/boring_model.py",
    "tests/helpers/runif.py",
    "tests/strategies/__init__.py",
]
# What the 2-CPU-rank run adds (not part of the PR): the shared harness and the CPU test module.
HARNESS = [
    "tests/conftest.py",
    "fsdp_harness/__init__.py",
    "fsdp_harness/cpu_fsdp.py",
    "fsdp_harness/forked_ranks.py",
    "fsdp_harness/multiprocess.py",
    "fsdp_harness/runner.py",
    "fsdp_harness/scenario.py",
    CPU_TEST_FILE,
]

GIT_ENV = {
    "GIT_AUTHOR_NAME": "ci", "GIT_AUTHOR_EMAIL": "ci@example.com",
    "GIT_COMMITTER_NAME": "ci", "GIT_COMMITTER_EMAIL": "ci@example.com",
}


def git(repo: Path, *args: str) -> str:
    proc = subprocess.run(
        ["git", *args], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **GIT_ENV},
    )
    assert proc.returncode == 0, f"git {' '.join(args)}:\n{proc.stdout}"
    return proc.stdout


def pr_only_patches() -> List:
    """The PR-only variant of the series: the compat patches and the upstream patch, without the fork's."""
    return [p for p in read_series() if p.name.startswith("compat/") or p.name == PATCH]


def _write(repo: Path, files: Dict[str, str]) -> None:
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)


def build_checkout(repo: Path, mail: Path, root: Path = ROOT) -> None:
    """Build the checkout described in the module docstring in ``repo`` (a new directory)."""
    repo.mkdir(parents=True)
    _write(repo, pristine_tree())
    _write(repo, {"CHANGELOG.md": UPSTREAM_CHANGELOG_HEAD})
    _write(repo, {rel: (root / rel).read_text() for rel in UPSTREAM_HELPERS})
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "upstream 1.6.5")
    git(repo, "apply", "--check", str(mail.resolve()))  # the PR applies to 1.6.5 itself

    compat = [p for p in pr_only_patches() if p.name.startswith("compat/")]
    _write(repo, patched_tree(patches=compat))
    git(repo, "commit", "-qam", "compat patches: run 1.6.5 on today's stack")
    git(repo, "apply", str(mail.resolve()))
    package = {
        path.relative_to(repo).as_posix(): path.read_text()
        for path in sorted((repo / "pytorch_lightning").rglob("*")) if path.is_file()
    }
    expected = patched_tree(patches=pr_only_patches())
    differ = sorted(p for p in set(package) | set(expected) if package.get(p) != expected.get(p))
    assert not differ, f"the applied PR differs from fork_tools' PR-only variant in {differ}"

    for rel in HARNESS:
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / rel, repo / rel)
