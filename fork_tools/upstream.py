"""Fetch and verify the pinned upstream wheel.

The wheel is obtained through ``python -m pip download`` by package name, so the user's own pip configuration
(index, proxy, certificates) applies and no URL lives in this repository. For offline builds point
``PL_FORK_UPSTREAM_WHEEL`` at a copy of the wheel, or ``PL_FORK_FIND_LINKS`` at a folder holding it.
"""
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple, Optional

ROOT = Path(__file__).resolve().parent.parent
PIN_FILE = ROOT / "requirements" / "upstream.txt"
CACHE_DIR = ROOT / ".upstream-cache"

ENV_WHEEL = "PL_FORK_UPSTREAM_WHEEL"
ENV_FIND_LINKS = "PL_FORK_FIND_LINKS"


class BuildError(RuntimeError):
    """A build input is missing or wrong; the message says which and what to do."""


class Pin(NamedTuple):
    name: str
    version: str
    sha256: str

    @property
    def wheel_name(self) -> str:
        return f"{self.name.replace('-', '_')}-{self.version}-py3-none-any.whl"


_PIN_RE = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)==(?P<version>\S+)\s+--hash=sha256:(?P<sha>[0-9a-f]{64})\s*$")


def read_pin(path: Path = PIN_FILE) -> Pin:
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _PIN_RE.match(line)
        if not match:
            raise BuildError(f"{path}: expected 'name==version --hash=sha256:<64 hex>', got {line!r}")
        return Pin(match["name"], match["version"], match["sha"])
    raise BuildError(f"{path}: no pin found")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(path: Path, pin: Pin) -> Path:
    actual = sha256_of(path)
    if actual != pin.sha256:
        raise BuildError(
            f"sha256 mismatch for upstream wheel {path}:\n  expected {pin.sha256} (pinned in {PIN_FILE.name})\n"
            f"  got      {actual}\nRefusing to build from an unverified upstream release."
        )
    return path


def _pip_download(pin: Pin, dest: Path, find_links: Optional[str]) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest)]
    if find_links:
        cmd += ["--no-index", "--find-links", find_links]
    cmd.append(f"{pin.name}=={pin.version}")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wheel = dest / pin.wheel_name
    if proc.returncode != 0 or not wheel.exists():
        where = f"in {find_links} (offline, {ENV_FIND_LINKS})" if find_links else "through pip"
        raise BuildError(
            f"could not obtain {pin.wheel_name} {where}.\n"
            f"For an offline build set {ENV_WHEEL}=/path/to/{pin.wheel_name} or {ENV_FIND_LINKS}=/folder/with/it.\n"
            f"pip said:\n{proc.stdout[-2000:]}"
        )
    return wheel


def fetch_wheel(pin: Optional[Pin] = None) -> Path:
    """Return a local path to the verified upstream wheel, downloading it into the cache if needed."""
    pin = pin or read_pin()
    local = os.environ.get(ENV_WHEEL)
    if local:
        path = Path(local)
        if not path.is_file():
            raise BuildError(f"{ENV_WHEEL}={local}: no such file (offline build needs the upstream wheel there)")
        return verify(path, pin)

    cached = CACHE_DIR / pin.wheel_name
    if cached.is_file() and sha256_of(cached) == pin.sha256:
        return cached

    CACHE_DIR.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        wheel = verify(_pip_download(pin, Path(tmp), os.environ.get(ENV_FIND_LINKS)), pin)
        os.replace(wheel, cached)
    return cached
