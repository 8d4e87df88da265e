"""The build: reproducible trees, clear failures on bad inputs, and the check/refresh maintainer workflow."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fork_tools import upstream
from fork_tools.materialize import PACKAGE, VERSION_FILE, fork_version, materialize
from fork_tools.overlay import read_overlay
from fork_tools.refresh import check, refresh
from fork_tools.revision import read_revision
from fork_tools.upstream import ENV_FIND_LINKS, ENV_WHEEL, ROOT, BuildError, Pin, fetch_wheel, read_pin
from tests.fork.conftest import add_patch
from tests.fork.synthetic import CHANGELOG_DIFF, MARKER, TARGET, synthetic_patch


def _files(root: Path) -> dict:
    pkg = root / PACKAGE
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(pkg.rglob("*")) if p.is_file()}


def test_two_clean_builds_are_byte_identical(offline_wheel, tmp_path):
    first, second = tmp_path / "one", tmp_path / "two"
    assert materialize(root=first) == materialize(root=second)
    a, b = _files(first), _files(second)
    assert len(a) > 100  # the whole package, not an empty tree
    assert a.keys() == b.keys()
    assert [path for path in a if a[path] != b[path]] == []
    assert f"+fsdp.{read_revision()}" in (first / PACKAGE / VERSION_FILE).read_text()



def test_compat_only_build_is_upstream_on_todays_stack(offline_wheel, tmp_path):
    """``groups=("compat",)`` (the benchmark's pure 1.6.5 baseline) applies the compat patches only, says so in its
    version, and a second call finds the tree up to date."""
    root = tmp_path / "compat"
    version = materialize(root=root, groups=("compat",))
    assert version == fork_version(read_pin()) + ".compat"
    package = root / PACKAGE
    assert version in (package / VERSION_FILE).read_text()
    assert "state_dict_on_rank_0_only" not in (package / "strategies" / "fully_sharded.py").read_text()
    assert "_fork_version" in (package / "__about__.py").read_text()  # compat/fork-version.patch is there
    assert [path for path in read_overlay() if (root / path).exists()] == []  # the overlay is the fork's
    stamp = (package / ".fork-stamp.json").stat().st_mtime_ns
    assert materialize(root=root, groups=("compat",)) == version
    assert (package / ".fork-stamp.json").stat().st_mtime_ns == stamp

def test_corrupted_patch_names_patch_and_hunk(offline_wheel, patch_copy, tmp_path):
    victim = patch_copy / "compat" / "numpy2-inf.patch"
    text = victim.read_text()
    context = "         self.min_delta *= 1 if self.monitor_op == torch.gt else -1\n"
    assert context in text
    victim.write_text(text.replace(context, "         self.min_delta *= 2  # corrupted context\n"))
    with pytest.raises(BuildError) as err:
        materialize(root=tmp_path / "tree", patch_dir=patch_copy)
    message = str(err.value)
    assert "compat/numpy2-inf.patch" in message
    assert "pytorch_lightning/callbacks/early_stopping.py" in message
    assert "hunk #1 '@@ -118,7 +118,7 @@'" in message
    assert not (tmp_path / "tree" / PACKAGE).exists()


def test_wrong_sha256_pin_is_refused(upstream_wheel, monkeypatch):
    monkeypatch.setenv(ENV_WHEEL, str(upstream_wheel))
    pin = read_pin()
    with pytest.raises(BuildError, match="sha256 mismatch") as err:
        fetch_wheel(Pin(pin.name, pin.version, "0" * 64))
    assert pin.sha256 in str(err.value) and "0" * 64 in str(err.value)


def test_offline_build_without_wheel_fails_clearly(monkeypatch, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.delenv(ENV_WHEEL, raising=False)
    monkeypatch.setenv(ENV_FIND_LINKS, str(empty))
    monkeypatch.setattr(upstream, "CACHE_DIR", tmp_path / "cache")  # no cached wheel to fall back on
    with pytest.raises(BuildError) as err:
        materialize(root=tmp_path / "tree")
    message = str(err.value)
    assert read_pin().wheel_name in message
    assert "offline" in message and ENV_WHEEL in message and str(empty) in message


def test_check_passes_on_fresh_tree_and_reports_edit(offline_wheel, tmp_path):
    root = tmp_path / "tree"
    materialize(root=root)
    assert check(root) == []
    edited = root / TARGET
    edited.write_text(edited.read_text() + "# local edit\n")
    assert check(root) == [f"differs: {TARGET}"]


def test_check_command_line(offline_wheel, tmp_path):
    # `python -m fork_tools materialize` / `check` as a maintainer runs them, in a copy of the repository so the
    # developer's own tree is left alone.
    clone = tmp_path / "clone"
    for part in ("fork_tools", "patches", "requirements", "overlay"):
        if (ROOT / part).is_dir():
            shutil.copytree(ROOT / part, clone / part, ignore=shutil.ignore_patterns("__pycache__"))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "fork_tools", *args], cwd=clone, capture_output=True, text=True)

    assert run("materialize").returncode == 0
    proc = run("check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equals upstream + patches/series" in proc.stdout
    edited = clone / TARGET
    edited.write_text(edited.read_text() + "# local edit\n")
    proc = run("check")
    assert proc.returncode == 1
    assert f"differs: {TARGET}" in proc.stdout


def test_refresh_new_patch_round_trip(offline_wheel, patch_copy, tmp_path):
    root = tmp_path / "tree"
    materialize(root=root, patch_dir=patch_copy)
    edited = root / TARGET
    edited.write_text(MARKER + edited.read_text())
    refresh("fork/test-edit.patch", subject="test edit", why="round trip", root=root, patch_dir=patch_copy)

    new_patch = (patch_copy / "fork/test-edit.patch").read_text()
    assert "Subject: [PATCH] test edit" in new_patch and f"+{MARKER}" in new_patch
    assert (patch_copy / "series").read_text().splitlines()[-1] == "fork/test-edit.patch"
    assert check(root, patch_copy) == []
    rebuilt = tmp_path / "rebuilt"
    materialize(root=rebuilt, patch_dir=patch_copy)
    assert (rebuilt / TARGET).read_text().startswith(MARKER)


def test_changelog_hunk_is_skipped_by_build_and_kept_by_refresh(offline_wheel, patch_copy, tmp_path):
    add_patch(patch_copy, "fork/synthetic.patch", synthetic_patch())
    root = tmp_path / "tree"
    materialize(root=root, patch_dir=patch_copy)
    assert (root / TARGET).read_text().startswith(MARKER)
    assert not (root / "CHANGELOG.md").exists()
    assert check(root, patch_copy) == []

    edited = root / TARGET
    edited.write_text(edited.read_text() + "# second edit\n")
    refresh("fork/synthetic.patch", root=root, patch_dir=patch_copy)
    text = (patch_copy / "fork/synthetic.patch").read_text()
    assert CHANGELOG_DIFF in text
    assert "+# second edit" in text and f"+{MARKER}" in text
    assert check(root, patch_copy) == []


def test_materialize_refuses_to_drop_unrefreshed_edits(offline_wheel, patch_copy, tmp_path):
    root = tmp_path / "tree"
    materialize(root=root, patch_dir=patch_copy)
    (root / TARGET).write_text("# edited\n")
    add_patch(patch_copy, "fork/synthetic.patch", synthetic_patch())
    with pytest.raises(BuildError, match="refresh"):
        materialize(root=root, patch_dir=patch_copy)
    shutil.rmtree(root)
    materialize(root=root, patch_dir=patch_copy)
    assert (root / TARGET).read_text().startswith(MARKER)
