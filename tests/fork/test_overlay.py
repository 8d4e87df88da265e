"""The overlay layout: fork modules under overlay/, their overrides checked for a target; refresh writes
module edits back and re-applies later patches by exact context.

Every build here is synthetic: a small series over the pinned wheel, diffed by fork_tools itself (no hand-written
line numbers), with its own overlay directory, all under tmp_path.
"""
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Dict, List, Tuple

import pytest

from fork_tools.export import check_test_imports, export
from fork_tools.materialize import PACKAGE, local_edits, materialize, pristine_tree
from fork_tools.refresh import check, refresh
from fork_tools.revision import bump_revision, read_revision, stale_revision
from fork_tools.series import Patch, Tree, apply_patch, exact_diff, read_series, unified_diff
from fork_tools.upstream import BuildError

HOST = "pytorch_lightning/strategies/fully_sharded.py"
STRATEGY = "pytorch_lightning/strategies/strategy.py"
OTHER = "pytorch_lightning/callbacks/early_stopping.py"
MIXIN = "pytorch_lightning/strategies/synthetic_mixin.py"
HOOK = "fork/synthetic-hook.patch"
LATER = "fork/synthetic-later.patch"
UNRELATED = "fork/synthetic-unrelated.patch"
COMPAT = "compat/synthetic-compat.patch"
IMPORT_LINE = "from pytorch_lightning.strategies.ddp import DDPStrategy\n"

MIXIN_SOURCE = '''"""A synthetic fork feature for the tests."""
# fork-feature: fork/synthetic-hook.patch
from typing_extensions import override


class SyntheticMixin:
{body}
'''
# Overrides DDPStrategy.teardown and adds a method of its own: what a well-formed mixin looks like.
GOOD_BODY = '''    @override
    def teardown(self) -> None:
        super().teardown()

    def synthetic_new_method(self) -> int:
        return 1'''

Edit = Callable[[Tree], None]


def replace(path: str, old: str, new: str) -> Edit:
    def edit(tree: Tree) -> None:
        assert tree[path].count(old) == 1, f"{old!r} is not once in {path}"
        tree[path] = tree[path].replace(old, new)

    return edit


def hook(bases: str = "SyntheticMixin, DDPStrategy", imports: str = "SyntheticMixin") -> Edit:
    """The fork/ touch point: import the mixin(s) and make them bases of DDPFullyShardedStrategy."""

    def edit(tree: Tree) -> None:
        new_import = f"from pytorch_lightning.strategies.synthetic_mixin import {imports}\n"
        replace(HOST, IMPORT_LINE, IMPORT_LINE + new_import)(tree)
        replace(HOST, "class DDPFullyShardedStrategy(DDPStrategy):", f"class DDPFullyShardedStrategy({bases}):")(tree)

    return edit


def header(name: str) -> str:
    return (
        f"From: Fork Tester <tester@example.com>\nSubject: [PATCH] synthetic {name}\n\n"
        "Description: A patch of the overlay tests' synthetic series.\nBug: no\nForwarded: no\n---\n"
    )


def write_series(patch_dir: Path, steps: List[Tuple[str, Edit]], context: int = 3) -> None:
    """A series whose patches are ``steps``' edits, each diffed against upstream + the patches before it."""
    tree = pristine_tree()
    patch_dir.mkdir(parents=True, exist_ok=True)
    for name, edit in steps:
        after = dict(tree)
        edit(after)
        (patch_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (patch_dir / name).write_text(header(name) + unified_diff(tree, after, context))
        tree = after
    (patch_dir / "series").write_text("".join(name + "\n" for name, _ in steps))
    if not (patch_dir / "revision").exists():
        (patch_dir / "revision").write_text("revision = 1\n")


def write_module(overlay_dir: Path, rel: str, text: str) -> Path:
    path = overlay_dir / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def fork(offline_wheel, tmp_path) -> SimpleNamespace:
    """A repository-like tmp root: a compat patch, the hook patch, and the mixin module in its overlay."""
    repo = tmp_path / "repo"
    ns = SimpleNamespace(root=repo, patch_dir=repo / "patches", overlay=repo / "overlay")
    ns.steps = [(COMPAT, replace(OTHER, "class EarlyStopping(", "# compat\nclass EarlyStopping(")), (HOOK, hook())]
    write_series(ns.patch_dir, ns.steps)
    write_module(ns.overlay, MIXIN, MIXIN_SOURCE.format(body=GOOD_BODY))
    ns.build = lambda **kw: materialize(root=ns.root, patch_dir=ns.patch_dir, overlay_dir=ns.overlay, **kw)
    ns.check = lambda: check(ns.root, ns.patch_dir, ns.overlay)
    ns.refresh = lambda *a, **kw: refresh(*a, root=ns.root, patch_dir=ns.patch_dir, overlay_dir=ns.overlay, **kw)
    return ns


def with_mixin(fork, body: str, steps=None) -> List[str]:
    """Rebuild ``fork`` with a mixin of this body (and these steps), and return what check says."""
    write_module(fork.overlay, MIXIN, MIXIN_SOURCE.format(body=body))
    if steps:
        write_series(fork.patch_dir, steps)
    fork.build()
    return fork.check()


# --- materialize ---------------------------------------------------------------------------------------------------


def test_fork_build_has_the_overlay_and_other_builds_do_not(fork, tmp_path):
    fork.build()
    module = fork.root / MIXIN
    assert module.read_text() == MIXIN_SOURCE.format(body=GOOD_BODY)
    assert "import SyntheticMixin" in (fork.root / HOST).read_text()
    assert fork.check() == []

    for groups in (("compat",), ("compat", "upstream")):
        root = tmp_path / "-".join(groups)
        materialize(root=root, patch_dir=fork.patch_dir, overlay_dir=fork.overlay, groups=groups)
        assert (root / OTHER).read_text().count("# compat\n") == 1
        assert not (root / MIXIN).exists()
        assert "SyntheticMixin" not in (root / HOST).read_text()

    # An overlay module is a tree file: an edit to it in the tree is an unrefreshed edit like any other.
    module.write_text(module.read_text() + "# local edit\n")
    assert local_edits(fork.root) == [MIXIN]


def test_a_series_cut_down_to_compat_builds_without_the_modules_of_the_features_it_lacks(fork, tmp_path):
    """Upstream's test oracle builds compat-only by cutting ``patches/series`` down to the compat lines, the overlay
    left as it is: the modules of the features left out are left out too, while a module naming a patch that does
    not exist is still refused."""
    (fork.patch_dir / "series").write_text(COMPAT + "\n")
    root = tmp_path / "cut"
    materialize(root=root, patch_dir=fork.patch_dir, overlay_dir=fork.overlay)
    assert not (root / MIXIN).exists()
    write_module(fork.overlay, "pytorch_lightning/strategies/typo.py", "# fork-feature: fork/no-such-feature.patch\n")
    with pytest.raises(BuildError, match="typo.py: '# fork-feature: fork/no-such-feature.patch' names no fork/ patch"):
        materialize(root=root, patch_dir=fork.patch_dir, overlay_dir=fork.overlay, force=True)


def test_overlay_edit_is_a_build_input_and_needs_a_bump(fork):
    bump_revision(fork.patch_dir, fork.overlay)
    fork.build()
    assert not stale_revision(fork.patch_dir, fork.overlay)
    write_module(fork.overlay, MIXIN, MIXIN_SOURCE.format(body=GOOD_BODY + "\n    # edited in overlay/"))
    assert stale_revision(fork.patch_dir, fork.overlay)
    fork.build()  # the tree is stale now and is rebuilt
    assert (fork.root / MIXIN).read_text().endswith("# edited in overlay/\n")


@pytest.mark.parametrize(
    "rel, text, message",
    [
        ("pytorch_lightning/strategies/ddp.py", "# fork-feature: fork/synthetic-hook.patch\n", "shadows"),
        ("pytorch_lightning/synthetic_created.py", "# fork-feature: fork/synthetic-hook.patch\n", "shadows"),
        ("pytorch_lightning/strategies/no_feature.py", '"""Doc."""\nimport os\n', "exactly one '# fork-feature"),
        ("pytorch_lightning/strategies/late.py", f"import os\n# fork-feature: {HOOK}\n", "exactly one"),
        ("pytorch_lightning/strategies/compat.py", f"# fork-feature: {COMPAT}\n", "names no fork/ patch"),
        ("pytorch_lightning/strategies/gone.py", "# fork-feature: fork/nope.patch\n", "names no fork/ patch"),
        ("pytorch_lightning/strategies/data.json", "{}\n", "Python modules under pytorch_lightning/ only"),
    ],
)
def test_build_refuses_an_overlay_module_that_breaks_the_rules(fork, rel, text, message):
    new_file = {"pytorch_lightning/synthetic_created.py": "x = 1\n"}
    created = ("fork/synthetic-creates.patch", lambda tree: tree.update(new_file))
    write_series(fork.patch_dir, fork.steps + [created])
    write_module(fork.overlay, rel, text)
    with pytest.raises(BuildError, match=re.escape(message)) as err:
        fork.build()
    assert f"overlay/{rel}" in str(err.value)
    assert not (fork.root / PACKAGE).exists()


# --- check: each kind of drift ------------------------------------------------------------------------------------


def test_check_reports_an_overlay_file_shadowing_upstream(fork):
    fork.build()
    write_module(fork.overlay, "pytorch_lightning/strategies/ddp.py", "# fork-feature: fork/synthetic-hook.patch\n")
    problems = fork.check()
    assert len(problems) == 1, problems
    assert problems[0].startswith(
        "overlay/pytorch_lightning/strategies/ddp.py shadows pytorch_lightning/strategies/ddp.py"
    )


def test_check_reports_override_of_nothing(fork):
    body = GOOD_BODY + "\n\n    @override\n    def synthetic_not_upstream(self) -> None:\n        pass"
    problems = with_mixin(fork, body)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"overlay/{MIXIN}:")
    assert "SyntheticMixin.synthetic_not_upstream is marked @override" in problems[0]
    assert "the MRO of SyntheticMixin, DDPFullyShardedStrategy (DDPStrategy, ParallelStrategy, Strategy)" in problems[0]


def test_check_reports_an_overridden_upstream_symbol_that_is_gone(fork):
    body = GOOD_BODY + "\n\n    @override\n    def optimizer_state(self, optimizer):\n        return {}"
    assert with_mixin(fork, body) == []
    # The pinned tree changes under the mixin: upstream renamed Strategy.optimizer_state.
    rename = replace(STRATEGY, " def optimizer_state(", " def optimizer_state_renamed(")
    renamed = ("compat/synthetic-rename.patch", rename)
    problems = with_mixin(fork, body, [renamed] + fork.steps)
    assert len(problems) == 1, problems
    assert "SyntheticMixin.optimizer_state is marked @override" in problems[0]
    assert "DDPFullyShardedStrategy" in problems[0] and "renamed or removed upstream" in problems[0]


def test_check_reports_overrides_without_target_whatever_class_holds_them(fork):
    """Not only a base class that a hook mixes in: a class of the overlay deriving from an upstream class, and a
    method that a patch adds to an upstream class, are checked the same way."""
    own_class = (
        "\n\nfrom pytorch_lightning.plugins.io.torch_plugin import TorchCheckpointIO\n\n\n"
        "class SyntheticCheckpointIO(TorchCheckpointIO):\n"
        "    @override\n    def remove_checkpoint(self, path) -> None:\n        pass\n\n"
        "    @override\n    def synthetic_renamed_upstream(self, path) -> None:\n        pass"
    )
    method = "    def model_to_device(self) -> None:\n"
    added = "    @override\n    def synthetic_gone(self) -> None:\n        pass\n\n"
    adds = (LATER, replace(HOST, method, added + method))
    problems = with_mixin(fork, GOOD_BODY + own_class, fork.steps + [adds])
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"{HOST}:") and "DDPFullyShardedStrategy.synthetic_gone is marked" in problems[0]
    assert problems[1].startswith(f"overlay/{MIXIN}:")
    assert "SyntheticCheckpointIO.synthetic_renamed_upstream is marked @override" in problems[1]
    assert "(TorchCheckpointIO, CheckpointIO) defines synthetic_renamed_upstream" in problems[1]


def test_check_reports_an_undecorated_override_between_two_overlay_classes(fork):
    earlier = "\n\nclass EarlierMixin:\n    def synthetic_hook(self) -> int:\n        return 0"
    body = GOOD_BODY + "\n\n    def synthetic_hook(self) -> int:\n        return 1" + earlier
    steps = [fork.steps[0], (HOOK, hook("EarlierMixin, SyntheticMixin, DDPStrategy", "EarlierMixin, SyntheticMixin"))]
    problems = with_mixin(fork, body, steps)
    # EarlierMixin.synthetic_hook overrides SyntheticMixin's, only in their host's MRO, without @override.
    assert len(problems) == 1, problems
    expected = "EarlierMixin.synthetic_hook overrides SyntheticMixin.synthetic_hook in the MRO of EarlierMixin, "
    assert expected in problems[0], problems

    # Decorated, the override has its target.
    cooperative = earlier.replace("    def", "    @override\n    def")
    cooperative = cooperative.replace("return 0", "return super().synthetic_hook()")
    assert with_mixin(fork, body.replace(earlier, cooperative)) == []


def test_check_reports_an_override_without_the_decorator(fork):
    problems = with_mixin(fork, GOOD_BODY + "\n\n    def barrier(self, name=None) -> None:\n        pass")
    assert len(problems) == 1, problems
    expected = "SyntheticMixin.barrier overrides DDPStrategy.barrier in the MRO of SyntheticMixin, DDPFullyShardedStr"
    assert expected in problems[0], problems


# --- application by exact context ---------------------------------------------------------------------------------


def test_stale_line_numbers_apply_when_the_context_is_unique(fork):
    fork.build()
    built = (fork.root / HOST).read_text()
    hook_patch = fork.patch_dir / HOOK
    shifted = lambda m: f"@@ -{int(m[1]) + 7},{m[2]} +{int(m[3]) + 7},"  # noqa: E731
    hook_patch.write_text(re.sub(r"^@@ -(\d+),(\d+) \+(\d+),", shifted, hook_patch.read_text(), flags=re.M))
    assert apply_patch(pristine_tree(), read_series(fork.patch_dir)[1])  # it reports the hunks that moved
    fork.build()
    assert (fork.root / HOST).read_text() == built


def test_ambiguous_or_missing_context_fails_naming_patch_file_and_hunk(fork):
    twice = "pytorch_lightning/synthetic_twice.py"
    creates = ("compat/synthetic-twice.patch", lambda tree: tree.update({twice: "a = 1\nb = 2\nc = 3\n" * 2}))
    # With one line of context the hunk's old lines (a, b, c) are both blocks: it could go in either.
    edits = ("fork/synthetic-edit-twice.patch", replace(twice, "c = 3\na = 1\nb = 2\n", "c = 3\na = 1\nb = 4\n"))
    write_series(fork.patch_dir, fork.steps + [creates, edits], context=1)
    with pytest.raises(BuildError) as err:
        fork.build()
    message = str(err.value)
    assert "fork/synthetic-edit-twice.patch" in message and twice in message
    assert re.search(r"hunk #1 '@@ -\d+,\d+ \+\d+,\d+ @@'", message)
    assert "occur 2 times in the file; they must occur exactly once" in message

    write_series(fork.patch_dir, fork.steps)
    hook_patch = fork.patch_dir / HOOK
    context = f" {IMPORT_LINE}"
    assert context in hook_patch.read_text()
    hook_patch.write_text(hook_patch.read_text().replace(context, context.replace("\n", "  # drifted\n")))
    with pytest.raises(BuildError, match=f"patch {HOOK} does not apply to {HOST} at hunk #1 .* are not in the file"):
        fork.build()


def test_exact_diff_widens_context_until_each_hunk_is_unique():
    path = "pytorch_lightning/synthetic.py"
    block = "a = 1\nb = 2\nc = 3\nd = 4\n"
    before = {path: "x = 0\n" + block * 4}
    after = {path: "x = 0\n" + block * 3 + block.replace("b = 2", "b = 5")}  # the last block only
    with pytest.raises(BuildError, match="occur 3 times"):
        apply_patch(dict(before), Patch(Path("plain.patch"), "", unified_diff(before, after), "plain.patch"))
    tree = dict(before)
    assert apply_patch(tree, Patch(Path("exact.patch"), "", exact_diff(before, after), "exact.patch")) == []
    assert tree == after


# --- refresh ------------------------------------------------------------------------------------------------------


def test_refresh_relocates_and_rewrites_a_later_patch(fork, tmp_path):
    method = "    def model_to_device(self) -> None:\n"
    later = (LATER, replace(HOST, method, method + "        # later\n"))
    unrelated = (UNRELATED, replace(OTHER, "# compat\n", "# compat\n# unrelated\n"))
    write_series(fork.patch_dir, fork.steps + [later, unrelated])
    fork.build()
    later_before = (fork.patch_dir / LATER).read_text()
    unrelated_before = (fork.patch_dir / UNRELATED).read_text()

    # Grow the hook by three lines: every line of the later patch's hunk moves down by three.
    host = fork.root / HOST
    grown = "from pytorch_lightning.strategies.synthetic_mixin import SyntheticMixin\n"
    host.write_text(host.read_text().replace(grown, grown + "# hook 1\n# hook 2\n# hook 3\n"))
    edited = host.read_text()
    fork.refresh(HOOK)

    later_after = (fork.patch_dir / LATER).read_text()
    old_start = [int(n) for n in re.findall(r"^@@ -(\d+),\d+ \+(\d+)", later_before, re.M)[0]]
    new_start = [int(n) for n in re.findall(r"^@@ -(\d+),\d+ \+(\d+)", later_after, re.M)[0]]
    assert new_start == [old_start[0] + 3, old_start[1] + 3]
    assert later_after.startswith(header(LATER))
    assert (fork.patch_dir / UNRELATED).read_text() == unrelated_before  # it did not move: left byte for byte
    assert "+# hook 3" in (fork.patch_dir / HOOK).read_text()
    assert read_revision(fork.patch_dir) == 2

    # The rewritten series applies at its own line numbers, and a fresh build gives the edited tree.
    tree = pristine_tree()
    assert [apply_patch(tree, patch) for patch in read_series(fork.patch_dir)] == [[]] * 4
    rebuilt = tmp_path / "rebuilt"
    materialize(root=rebuilt, patch_dir=fork.patch_dir, overlay_dir=fork.overlay)
    assert (rebuilt / HOST).read_text() == edited
    assert fork.check() == []


def test_refresh_writes_overlay_edits_back(fork):
    fork.build()
    hook_before = (fork.patch_dir / HOOK).read_text()
    module = fork.root / MIXIN
    module.write_text(module.read_text() + "\n    def synthetic_added(self) -> int:\n        return 2\n")
    new = fork.root / "pytorch_lightning/strategies/synthetic_extra.py"
    new.write_text("# fork-feature: fork/synthetic-hook.patch\nEXTRA = 1\n")

    report = fork.refresh()  # only overlay edits: no patch name needed
    assert f"overlay/{MIXIN}" in report
    assert (fork.overlay / MIXIN).read_text() == module.read_text()
    assert (fork.overlay / "pytorch_lightning/strategies/synthetic_extra.py").read_text() == new.read_text()
    assert (fork.patch_dir / HOOK).read_text() == hook_before  # no patch took the module edits
    assert read_revision(fork.patch_dir) == 2 and not stale_revision(fork.patch_dir, fork.overlay)
    assert fork.check() == [] and local_edits(fork.root) == []

    # An edit outside the overlay still needs the patch that owns it.
    host = fork.root / HOST
    host.write_text(host.read_text() + "# stray\n")
    with pytest.raises(BuildError, match="belong in a patch: name it"):
        fork.refresh()


def _files(*folders: Path) -> Dict[str, bytes]:
    return {str(path): path.read_bytes() for folder in folders for path in sorted(folder.rglob("*")) if path.is_file()}


def _break_the_overlay(fork) -> None:
    write_module(fork.overlay, "pytorch_lightning/strategies/synthetic_new.py", f"# fork-feature: {HOOK}\nNEW = (\n")


def _break_a_patch(fork) -> None:
    hook_patch = fork.patch_dir / HOOK
    hook_patch.write_text(hook_patch.read_text().replace(f" {IMPORT_LINE}", f" {IMPORT_LINE.strip()}  # drifted\n"))


@pytest.mark.parametrize(
    ("breaks", "build_error"), [(_break_the_overlay, "does not parse"), (_break_a_patch, "does not apply")]
)
def test_refresh_refuses_a_tree_left_stale_by_a_failed_build(fork, breaks, build_error):
    """A failed ``materialize`` leaves the previous tree in place. Taking that tree for edits, refresh would write its
    old copy of an edited module back to overlay/ and delete a module that is new in overlay/."""
    fork.build()
    write_module(fork.overlay, MIXIN, MIXIN_SOURCE.format(body=GOOD_BODY + "\n    # edited in overlay/"))
    breaks(fork)
    with pytest.raises(BuildError, match=build_error):
        fork.build()
    inputs = _files(fork.overlay, fork.patch_dir)
    with pytest.raises(BuildError, match="was built from other inputs than patches/ and overlay/ hold now") as err:
        fork.refresh()
    assert "run 'python -m fork_tools materialize'" in str(err.value)
    assert _files(fork.overlay, fork.patch_dir) == inputs


# --- export -------------------------------------------------------------------------------------------------------


def test_export_refuses_a_patch_that_imports_an_overlay_module(fork, tmp_path):
    out = tmp_path / "pr.patch"
    with pytest.raises(BuildError, match="imports the fork's overlay modules") as err:
        export(HOOK, [], out, patch_dir=fork.patch_dir, root=fork.root, overlay_dir=fork.overlay)
    assert f"{HOST}: +from pytorch_lightning.strategies.synthetic_mixin import SyntheticMixin" in str(err.value)
    assert not out.exists()
    # The compat patch imports nothing of the overlay and exports.
    export(COMPAT, [], out, patch_dir=fork.patch_dir, root=fork.root, overlay_dir=fork.overlay)
    assert out.exists()


def test_exported_tests_may_not_import_overlay_modules():
    source = {"tests/test_x.py": "from pytorch_lightning.strategies import synthetic_mixin\nimport pytorch_lightning\n"}
    assert check_test_imports(source) == []
    problems = check_test_imports(source, {"pytorch_lightning.strategies.synthetic_mixin"})
    assert problems == ["tests/test_x.py:1: imports pytorch_lightning.strategies (synthetic_mixin)"]


# --- the real repository ------------------------------------------------------------------------------------------


def test_check_passes_on_the_real_series_and_overlay(offline_wheel, tmp_path):
    """The real patches/ and overlay/, built fresh: no overlay rule broken, no mixin drift."""
    materialize(root=tmp_path / "real")
    assert check(tmp_path / "real") == []
