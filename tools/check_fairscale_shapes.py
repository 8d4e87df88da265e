"""Check the FairScale interposer's shape check against every FairScale release that ``requirements/base.txt``
allows, not only the installed one.

Download the releases first (they are sdists; nothing is installed)::

    for v in 0.4.5 0.4.6 0.4.7 0.4.8 0.4.9 0.4.10 0.4.11 0.4.12 0.4.13; do
        python -m pip download --no-deps fairscale==$v -d /tmp/fairscale-releases
    done
    python tools/check_fairscale_shapes.py /tmp/fairscale-releases/*

Each release is unpacked into a temporary folder and imported, ahead of the installed FairScale, in a process of its
own, which prints what ``_fairscale_interposer_problems`` finds in its FSDP module. Run it from the repository root
after ``python -m fork_tools materialize``. Exits 1 if any release lacks something or does not import.
"""
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import List, Tuple

# 0.4.7's ``import fairscale`` imports its experimental ``wgit``, which needs pygit2 and pgzip (not declared);
# stand-ins let that release import, and nothing checked here uses them.
PROBE = """
import sys, types
sys.modules.update({name: types.ModuleType(name) for name in ("pygit2", "pgzip") if name not in sys.modules})
import fairscale
import fairscale.nn.data_parallel.fully_sharded_data_parallel as fsdp_module
from pytorch_lightning.strategies.fsdp_guarded_gathers import _fairscale_interposer_problems
assert fairscale.__file__.startswith(SOURCE), fairscale.__file__
problems = _fairscale_interposer_problems(fsdp_module)
print("; ".join(problems) or "ok")
"""


def unpack_release(archive: Path, into: Path) -> Path:
    """The folder of ``archive`` (an sdist or a wheel) that holds the ``fairscale`` package."""
    if archive.suffix == ".whl":
        zipfile.ZipFile(archive).extractall(into)
    else:
        with tarfile.open(archive) as tar:
            tar.extractall(into)
    return next(path.parent.parent for path in sorted(into.rglob("fairscale/__init__.py")))


def release_version(archive: Path) -> Tuple[int, ...]:
    """``fairscale-0.4.10.tar.gz`` -> ``(0, 4, 10)``, to list the releases in order."""
    return tuple(int(part) for part in re.findall(r"\d+", archive.name.split("-")[1].split(".tar")[0])[:3])


def release_problems(archive: Path) -> str:
    """What the shape check says about the release in ``archive``, or why it could not be imported."""
    with tempfile.TemporaryDirectory() as tmp:
        source = str(unpack_release(archive, Path(tmp)))
        probe = PROBE.replace("SOURCE", repr(source))
        env_path = [source, str(Path.cwd())]
        result = subprocess.run(
            [sys.executable, "-c", f"import sys; sys.path[:0] = {env_path!r}\n{probe}"],
            capture_output=True,
            text=True,
        )
    if result.returncode:
        return "does not import: " + (result.stderr.strip().splitlines() or ["?"])[-1]
    return result.stdout.strip()


def main(paths: List[str]) -> int:
    found = [p for path in map(Path, paths) for p in (sorted(path.glob("fairscale-*")) if path.is_dir() else [path])]
    archives = sorted((p for p in found if p.name.endswith((".tar.gz", ".whl"))), key=release_version)
    failed = 0
    for archive in archives:
        outcome = release_problems(archive)
        failed += outcome != "ok"
        print(f"{archive.name}: {outcome}")
    return 1 if failed or not archives else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
