"""Fixtures for the fork's own tests: the verified upstream wheel and throwaway copies of patches/."""
import shutil
from pathlib import Path

import pytest

from fork_tools.series import PATCH_DIR
from fork_tools.upstream import ENV_FIND_LINKS, ENV_WHEEL, fetch_wheel


@pytest.fixture(scope="session")
def upstream_wheel() -> Path:
    # Fetched (or taken from the cache / PL_FORK_UPSTREAM_WHEEL) once; every build test reuses it.
    return fetch_wheel()


@pytest.fixture
def offline_wheel(upstream_wheel, monkeypatch) -> Path:
    """Builds in this test use the verified wheel directly and never touch pip or the network."""
    monkeypatch.setenv(ENV_WHEEL, str(upstream_wheel))
    monkeypatch.delenv(ENV_FIND_LINKS, raising=False)
    return upstream_wheel


@pytest.fixture
def patch_copy(tmp_path) -> Path:
    """A private copy of patches/ that a test may corrupt or extend."""
    return Path(shutil.copytree(PATCH_DIR, tmp_path / "patches"))


def add_patch(patch_dir: Path, name: str, text: str) -> Path:
    """Append a patch to the series in ``patch_dir``."""
    path = patch_dir / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    with open(patch_dir / "series", "a") as f:
        f.write(name + "\n")
    return path
