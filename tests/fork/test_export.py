"""`python -m fork_tools export`: a git-am mail that applies to upstream 1.6.5 (pristine wheel tree + CHANGELOG)."""
import os
import subprocess
from pathlib import Path

import pytest

from fork_tools.export import check_test_imports, export
from fork_tools.materialize import pristine_tree
from fork_tools.upstream import BuildError
from tests.fork.conftest import add_patch
from tests.fork.synthetic import CHANGELOG_DIFF, MARKER, TARGET, changelog_preimage, synthetic_patch

TEST_FILE = "tests/callbacks/test_synthetic_change.py"
TEST_SOURCE = '''import pytest

from pytorch_lightning import Trainer
from tests.helpers import BoringModel
from tests.helpers.runif import RunIf


@RunIf(min_gpus=2, standalone=True)
def test_synthetic():
    Trainer(fast_dev_run=True).fit(BoringModel())
'''
GIT_ENV = {
    "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com",
}


def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, env={**os.environ, **GIT_ENV})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.fixture
def upstream_repo(offline_wheel, tmp_path) -> Path:
    """Upstream tag 1.6.5 as far as the PR touches it: the wheel's package plus a CHANGELOG.md for the hunk."""
    repo = tmp_path / "upstream"
    for rel, text in pristine_tree().items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    (repo / "CHANGELOG.md").write_text(changelog_preimage())
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "upstream 1.6.5")
    return repo


@pytest.fixture
def fork_copy(offline_wheel, patch_copy, tmp_path) -> Path:
    """A repository root with the synthetic patch in its series and one new test file."""
    add_patch(patch_copy, "fork/synthetic.patch", synthetic_patch())
    (patch_copy.parent / TEST_FILE).parent.mkdir(parents=True)
    (patch_copy.parent / TEST_FILE).write_text(TEST_SOURCE)
    return patch_copy.parent


def test_export_applies_to_upstream(fork_copy, upstream_repo, tmp_path):
    out = tmp_path / "pr.patch"
    report = export(
        "fork/synthetic.patch", [fork_copy / TEST_FILE], out, upstream=upstream_repo,
        patch_dir=fork_copy / "patches", root=fork_copy,
    )
    assert "git apply --check: OK" in report and "no CHANGELOG" not in report
    mail = out.read_text()
    head, _, diffs = mail.partition("\n---\n")
    assert head.startswith("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n")
    assert "\nFrom: Fork Tester <tester@example.com>\n" in head and "\nDate: " in head
    assert "\nSubject: [PATCH] test: synthetic upstream-bound change\n" in head
    assert "A change that exists only in the fork's tests" in head
    assert "Bug: https://github.com/Lightning-AI/lightning/issues/11207" in head
    assert "Forwarded" not in head  # a fork bookkeeping field, not part of the upstream commit message
    assert CHANGELOG_DIFF in diffs and f"+{MARKER}" in diffs
    assert (
        f"diff --git a/{TEST_FILE} b/{TEST_FILE}\nnew file mode 100644\n--- /dev/null\n+++ b/{TEST_FILE}\n" in diffs
    )

    # git am takes it as one commit with the right author and subject, and the files end up as intended.
    _git(upstream_repo, "am", "-q", str(out))
    assert _git(upstream_repo, "log", "-1", "--format=%an|%s") == "Fork Tester|test: synthetic upstream-bound change\n"
    assert (upstream_repo / TEST_FILE).read_text() == TEST_SOURCE
    assert (upstream_repo / TARGET).read_text().startswith(MARKER)
    assert "Synthetic change used by the fork's tests" in (upstream_repo / "CHANGELOG.md").read_text()


def test_export_reports_git_apply_failure(fork_copy, upstream_repo, tmp_path):
    (upstream_repo / "CHANGELOG.md").write_text("# a different changelog\n")
    with pytest.raises(BuildError, match="git apply --check .* failed") as err:
        export("fork/synthetic.patch", [], tmp_path / "pr.patch", upstream=upstream_repo,
               patch_dir=fork_copy / "patches", root=fork_copy)
    assert "CHANGELOG.md" in str(err.value)


def test_export_rejects_fork_only_imports(fork_copy, tmp_path):
    bad = fork_copy / "tests" / "callbacks" / "test_bad.py"
    bad.write_text("import numpy\nfrom tests.helpers.cpu_fsdp import x\nfrom tests.helpers import BoringModel, Fancy\n")
    with pytest.raises(BuildError, match="upstream 1.6.5 does not have") as err:
        export("fork/synthetic.patch", [bad], tmp_path / "pr.patch", patch_dir=fork_copy / "patches", root=fork_copy)
    message = str(err.value)
    assert "test_bad.py:1: imports numpy" in message
    assert "test_bad.py:2: imports tests.helpers.cpu_fsdp" in message
    assert "test_bad.py:3: imports tests.helpers (BoringModel, Fancy)" in message
    assert not (tmp_path / "pr.patch").exists()


def test_imports_of_exported_files_are_allowed():
    files = {
        "tests/strategies/helper_mod.py": "import os\nimport torch.nn as nn\nfrom fairscale.nn import wrap\n",
        "tests/strategies/test_x.py": "from . import helper_mod\nfrom .helper_mod import nn\n"
        "from tests.strategies.helper_mod import wrap\n",
    }
    assert check_test_imports(files) == []
    files["tests/strategies/test_x.py"] += "from .other import thing\n"
    assert check_test_imports(files) == ["tests/strategies/test_x.py:4: imports tests.strategies.other (thing)"]


def test_export_unknown_patch(patch_copy, tmp_path):
    with pytest.raises(BuildError, match="not in .*series"):
        export("fork/nope.patch", [], tmp_path / "x", patch_dir=patch_copy, root=patch_copy.parent)
