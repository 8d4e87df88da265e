"""Host memory that a process can still allocate: the host's ``MemAvailable`` and, tighter where one is set, the limit
of each memory cgroup the process is in (a container's, a Slurm job's) minus what that cgroup uses, read from
``/proc`` and the cgroup filesystem, v1 or v2.

Used by :mod:`~pytorch_lightning.strategies.fsdp_checkpoint_errors`, which checks before
a checkpoint is gathered (and before an asynchronous save copies the ranks' shards into host memory) that the ranks
under each bound have the memory for what they will hold together.
"""
# fork-feature: fork/checkpoint-errors-on-every-rank.patch
import os
import re
from typing import Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple

from pytorch_lightning.utilities.atomic_save import _boot_id

#: where ``procfs`` is mounted (the tests point this at a fake one)
PROC_ROOT = "/proc"

#: cgroup limits at or above this many bytes mean "no limit" (cgroup v1 writes ``PAGE_COUNTER_MAX`` pages)
_UNLIMITED = 2**60

#: the limit, usage and statistics files of a memory cgroup, and the statistic of its reclaimable file cache, by version
_CGROUP_FILES = {
    1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat", "total_inactive_file"),
    2: ("memory.max", "memory.current", "memory.stat", "inactive_file"),
}


class MemoryBound(NamedTuple):
    """A bound on the host memory a process can still allocate.

    Args:
        key: the same for every process under this bound, on any host: ``("host", boot id)`` for the host's
            ``MemAvailable``, ``("cgroup", boot id, device, inode)`` for a memory cgroup.
        description: what the bound is, for messages.
        available: how many bytes are left under it.
    """

    key: Tuple[Hashable, ...]
    description: str
    available: int


def host_memory_bounds(proc_root: Optional[str] = None) -> List[MemoryBound]:
    """The bounds on the host memory this process can still allocate: the host's ``MemAvailable`` (from
    ``/proc/meminfo``), and for every memory cgroup this process is in, from its own up to the top of the hierarchy
    mounted here, that has a limit: that limit minus the cgroup's usage, not counting its inactive file cache, which the
    kernel reclaims before it runs out of memory (cgroup v2: ``memory.max``, ``memory.current`` and ``inactive_file``
    of ``memory.stat``; v1: ``memory.limit_in_bytes``, ``memory.usage_in_bytes`` and ``total_inactive_file``). The
    cgroups are found through ``/proc/self/cgroup`` and ``/proc/self/mountinfo``. Whatever cannot be read (not
    Linux, no cgroup filesystem) gives no bound.

    Args:
        proc_root: where ``procfs`` is mounted, :data:`PROC_ROOT` by default.
    """
    proc_root = proc_root or PROC_ROOT
    boot_id = _boot_id(proc_root)
    bounds = []
    available = _mem_available(proc_root)
    if available is not None:
        bounds.append(MemoryBound(("host", boot_id), "the host's `MemAvailable`", available))
    for directory, version in _memory_cgroup_directories(proc_root):
        bound = _cgroup_bound(directory, version, boot_id)
        if bound is not None:
            bounds.append(bound)
    return bounds


def overcommitted_bound(
    reports: Sequence[Tuple[int, Sequence[MemoryBound]]]
) -> Optional[Tuple[MemoryBound, List[int], int]]:
    """The first bound under which the processes need more memory together than it allows, as ``(bound, their
    indices, bytes they need)``, or ``None``.

    Args:
        reports: for each process, the bytes it needs and its bounds (:func:`host_memory_bounds`). Processes under
            the same bound (the same key: on one host, or in one cgroup) add up; the smallest of their readings of
            what is available counts.
    """
    shared: Dict[Tuple[Hashable, ...], Tuple[MemoryBound, List[int], int]] = {}
    for index, (needed, bounds) in enumerate(reports):
        for bound in bounds:
            tightest, indices, total = shared.get(bound.key, (bound, [], 0))
            shared[bound.key] = (min(tightest, bound, key=lambda b: b.available), indices + [index], total + needed)
    for bound, indices, needed in shared.values():
        if needed > bound.available:
            return bound, indices, needed
    return None


def pinned_host_bytes(nbytes: int) -> int:
    """The bytes torch's pinned host allocator (``CachingHostAllocator``, behind ``pin_memory=True`` and
    ``Tensor.pin_memory()``) takes for a tensor of ``nbytes``: a block rounded up to the next power of two, so that
    blocks of one size class can be reused (a freed block stays cached for that). A 1.1 GiB shard takes 2 GiB."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def format_bytes(size: int) -> str:
    """``size`` in bytes, KiB, MiB, GiB or TiB, for messages."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _mem_available(proc_root: str) -> Optional[int]:
    try:
        with open(os.path.join(proc_root, "meminfo")) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _unescape(field: str) -> str:
    # mountinfo writes spaces, tabs, newlines and backslashes in paths as octal escapes
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _memory_cgroup_directories(proc_root: str) -> List[Tuple[str, int]]:
    """The directories of the memory cgroups this process is in, each with its cgroup version, innermost first."""
    paths: Dict[int, str] = {}
    try:
        with open(os.path.join(proc_root, "self", "cgroup")) as cgroup:
            for line in cgroup:
                hierarchy, controllers, path = line.rstrip("\n").split(":", 2)
                if hierarchy == "0" and not controllers:
                    paths[2] = path
                elif "memory" in controllers.split(","):
                    paths[1] = path
        with open(os.path.join(proc_root, "self", "mountinfo")) as mountinfo:
            mounts = [line.split() for line in mountinfo]
    except (OSError, ValueError):
        return []
    directories = []
    for fields in mounts:
        if "-" not in fields[6:]:
            continue
        separator = fields.index("-", 6)
        if len(fields) < separator + 4:
            continue
        fstype, options = fields[separator + 1], fields[separator + 3].split(",")
        version = 2 if fstype == "cgroup2" else 1 if fstype == "cgroup" and "memory" in options else None
        if version is None or version not in paths:
            continue
        root, mount_point, path = _unescape(fields[3]), _unescape(fields[4]), paths[version]
        # the mount shows the hierarchy from ``root`` on; a cgroup outside it (another cgroup namespace) is the mount's
        if root == "/" or path == root or path.startswith(root.rstrip("/") + "/"):
            relative = path[len(root) :] if root != "/" else path
        else:
            relative = ""
        directory = os.path.normpath(os.path.join(mount_point, relative.lstrip("/")))
        while True:
            directories.append((directory, version))
            if directory == os.path.normpath(mount_point) or os.path.dirname(directory) == directory:
                break
            directory = os.path.dirname(directory)
    return directories


def _cgroup_bound(directory: str, version: int, boot_id: str) -> Optional[MemoryBound]:
    limit_file, usage_file, stat_file, reclaimable = _CGROUP_FILES[version]
    try:
        with open(os.path.join(directory, limit_file)) as f:
            limit_text = f.read().strip()
        if limit_text == "max" or int(limit_text) >= _UNLIMITED:
            return None
        limit = int(limit_text)
        with open(os.path.join(directory, usage_file)) as f:
            usage = int(f.read().strip())
        inactive_file = 0
        try:
            with open(os.path.join(directory, stat_file)) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == reclaimable:
                        inactive_file = int(value)
        except (OSError, ValueError):
            pass
        st = os.stat(directory)
    except (OSError, ValueError):
        return None
    used = max(usage - inactive_file, 0)
    description = f"the memory cgroup {directory!r} (limit {format_bytes(limit)}, {format_bytes(used)} in use)"
    return MemoryBound(("cgroup", boot_id, st.st_dev, st.st_ino), description, max(limit - used, 0))
