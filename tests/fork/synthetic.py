"""A small upstream-bound patch, built from the real patched tree, with a CHANGELOG.md hunk as upstream's PRs have."""
from fork_tools.materialize import patched_tree
from fork_tools.series import unified_diff

TARGET = "pytorch_lightning/callbacks/early_stopping.py"
MARKER = "# fork test: synthetic upstream-bound change\n"

HEADER = """From: Fork Tester <tester@example.com>
Subject: [PATCH] test: synthetic upstream-bound change

Description: A change that exists only in the fork's tests, to exercise export and
 the handling of CHANGELOG hunks.
Bug: https://github.com/Lightning-AI/lightning/issues/11207
Forwarded: not yet
---
"""

# Written against a CHANGELOG.md with these three context lines at the given place; tests synthesise one.
CHANGELOG_DIFF = """diff --git a/CHANGELOG.md b/CHANGELOG.md
--- a/CHANGELOG.md
+++ b/CHANGELOG.md
@@ -5,6 +5,10 @@
 The format is based on [Keep a Changelog](http://keepachangelog.com/en/1.0.0/).
 
 
+## [1.6.6] - unreleased
+
+- Synthetic change used by the fork's tests
+
 ## [1.6.5] - 2022-07-13
 
 ### Fixed
"""


def package_diff() -> str:
    """A diff that adds MARKER on top of upstream + the current series."""
    before = patched_tree()
    after = dict(before)
    after[TARGET] = MARKER + before[TARGET]
    return unified_diff(before, after)


def synthetic_patch() -> str:
    return HEADER + CHANGELOG_DIFF + package_diff()


def changelog_preimage() -> str:
    """A CHANGELOG.md that the hunk above applies to exactly: filler up to the hunk, then its old lines."""
    old_lines = [ln[1:] for ln in CHANGELOG_DIFF.splitlines()[4:] if ln[:1] in (" ", "-")]
    filler = ["# Changelog", "All notable changes to this project will be documented in this file.", "", ""]
    return "\n".join(filler + old_lines) + "\n"
