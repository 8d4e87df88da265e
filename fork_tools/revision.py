"""The fork revision: the ``N`` of version ``1.6.5.post0+fsdp.N``.

It is a number kept in ``patches/revision``, not derived from the series, so that it only ever grows: squashing or
splitting patches must not make a newer build look older. ``patches/revision`` also records the sha256 of the
series it was last bumped for; ``python -m fork_tools check`` and the test suite fail while the two disagree, and
``refresh`` bumps it itself. After editing a patch by hand, run ``python -m fork_tools bump``. The overlay modules
(``overlay/``) are part of the series in this sense: editing one is a change to the fork like editing a patch.
"""
import hashlib
import re
from pathlib import Path

from fork_tools.overlay import OVERLAY_DIR, overlay_files
from fork_tools.series import PATCH_DIR, read_series
from fork_tools.upstream import BuildError

REVISION_FILE = "revision"
_FIELD = re.compile(r"^(?P<key>[a-z0-9-]+)\s*=\s*(?P<value>\S+)\s*$", re.M)


def series_digest(patch_dir: Path = PATCH_DIR, overlay_dir: Path = OVERLAY_DIR) -> str:
    """sha256 over the series file, every patch it lists, in order, and every overlay file, by path."""
    digest = hashlib.sha256((patch_dir / "series").read_bytes())
    for patch in read_series(patch_dir):
        digest.update(patch.name.encode() + b"\0" + patch.path.read_bytes())
    # Without overlay files the digest is what it was before the overlay existed.
    for rel, path in overlay_files(overlay_dir).items():
        digest.update(b"overlay\0" + rel.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _read(patch_dir: Path) -> dict:
    path = patch_dir / REVISION_FILE
    try:
        fields = {m.group("key"): m.group("value") for m in _FIELD.finditer(path.read_text())}
        return {"revision": int(fields["revision"]), "series-sha256": fields.get("series-sha256", "")}
    except (OSError, KeyError, ValueError) as err:
        raise BuildError(f"{path} must hold 'revision = <integer>' ({err})") from None


def read_revision(patch_dir: Path = PATCH_DIR) -> int:
    return _read(patch_dir)["revision"]


def stale_revision(patch_dir: Path = PATCH_DIR, overlay_dir: Path = OVERLAY_DIR) -> bool:
    """Whether the series (or the overlay) changed since the revision was last bumped."""
    return _read(patch_dir)["series-sha256"] != series_digest(patch_dir, overlay_dir)


def bump_revision(patch_dir: Path = PATCH_DIR, overlay_dir: Path = OVERLAY_DIR) -> int:
    """Increase the revision by one and record the current series digest; returns the new revision."""
    revision = read_revision(patch_dir) + 1
    (patch_dir / REVISION_FILE).write_text(
        "# The fork revision N of version 1.6.5.post0+fsdp.N; `python -m fork_tools bump` raises it after every\n"
        "# change to the series (refresh does it itself). series-sha256 is the series it was raised for.\n"
        f"revision = {revision}\nseries-sha256 = {series_digest(patch_dir, overlay_dir)}\n"
    )
    return revision
