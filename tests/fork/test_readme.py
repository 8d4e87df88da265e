"""README.md stays a start page: within its budget, its test command the one CI runs, its options table complete
for the fork's run-time environment variables, and its links (and those of the reference pages) pointing at files
that exist. Its Python quick start runs in ``tests/strategies/test_ddp_fully_sharded_readme.py``."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_CHARS = 8000


def _readme() -> str:
    return README.read_text()


def test_readme_within_budget():
    assert len(_readme()) <= MAX_README_CHARS, f"README.md has {len(_readme())} characters; move details to docs/"


def test_ci_runs_the_readme_test_command():
    readme_pytest = re.findall(r"\.venv/bin/python (-m pytest [^`\n]*)", _readme())
    ci_pytest = re.findall(r'"\$VENV_PY" (-m pytest [^\n]*)', (ROOT / ".ci" / "run").read_text())
    assert len(readme_pytest) == 1 and ci_pytest == readme_pytest, (readme_pytest, ci_pytest)
    assert "--durations=20" in ci_pytest[0]


def _runtime_variables() -> set:
    # the fork's own: string constants in its overlay modules (upstream's, such as PL_FAULT_TOLERANT_TRAINING, and
    # the build's PL_FORK_* are not there)
    found = set()
    for path in (ROOT / "overlay").rglob("*.py"):
        found |= set(re.findall(r"\"(PL_[A-Z_]+)\"", path.read_text()))
    return found


def test_options_table_lists_every_runtime_variable():
    variables = _runtime_variables()
    assert variables, "no PL_* variable found in overlay/"
    rows = {m for m in re.findall(r"^\| `(PL_[A-Z_]+)` \|", _readme(), flags=re.MULTILINE)}
    assert variables <= rows, f"not in README.md's options table: {sorted(variables - rows)}"


def test_links_point_at_files():
    pages = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
