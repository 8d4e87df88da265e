"""A fake ``/proc`` and cgroup filesystem, as a Slurm job with ``ConstrainRAMSpace`` or a Kubernetes container sees
them, for ``pytorch_lightning.utilities.host_memory`` (point its ``PROC_ROOT``, or the ``proc_root`` argument, at
:attr:`FakeProc.proc`).

The process is in cgroup ``/job_1/step_0``; the memory limit is set on ``/job_1`` (the step has none), as Slurm sets
it. cgroup v2 mounts the unified hierarchy at ``<root>/sys/fs/cgroup``; v1 mounts the memory controller at
``<root>/sys/fs/cgroup/memory``, also with a mount ``root`` other than ``/`` (a container without a cgroup namespace
sees its host's hierarchy from its own cgroup on).
"""
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

KIB = 1024

#: cgroup v1's "no limit": ``PAGE_COUNTER_MAX`` pages of 4 KiB
V1_UNLIMITED = 9223372036854771712


class FakeProc:
    """Writes the files; change the memory figures with :meth:`set_mem_available` and :meth:`set_job_memory`.

    Args:
        root: an empty folder for the fake filesystems.
        version: the cgroup version, 1 or 2.
        mount_root: the ``root`` field of the cgroup mount in ``mountinfo`` (v1), e.g. ``"/job_1"``.
        boot_id: the kernel's boot id, which tells the hosts apart.
        create: ``False`` only finds the files that another process created with these arguments.
    """

    def __init__(
        self, root: Path, version: int = 2, mount_root: str = "/", boot_id: str = "fake-boot-id", create: bool = True
    ) -> None:
        self.root, self.version = Path(root), version
        self.proc = self.root / "proc"
        mount_point = Path(str(self.root / "sys" / "fs" / "cgroup" / ("memory" if version == 1 else "")).rstrip("/"))
        # the folders as this process's mount shows them: below ``mount_root``
        inside = "/job_1/step_0"[len(mount_root.rstrip("/")) :] if mount_root != "/" else "/job_1/step_0"
        self.step = mount_point / inside.lstrip("/")
        self.job = self.step.parent if inside.strip("/").count("/") else mount_point
        if not create:
            return
        (self.proc / "self").mkdir(parents=True)
        (self.proc / "sys" / "kernel" / "random").mkdir(parents=True)
        (self.proc / "sys" / "kernel" / "random" / "boot_id").write_text(boot_id + "\n")
        if version == 2:
            (self.proc / "self" / "cgroup").write_text("0::/job_1/step_0\n")
            cgroup_mount = f"30 25 0:26 / {self._escape(mount_point)} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
        else:
            (self.proc / "self" / "cgroup").write_text(
                "12:pids:/job_1/step_0\n11:memory:/job_1/step_0\n10:cpu,cpuacct:/job_1/step_0\n1:name=systemd:/\n"
            )
            cgroup_mount = (
                f"35 25 0:31 {mount_root} {self._escape(mount_point)} rw,nosuid shared:15 - cgroup cgroup rw,memory\n"
            )
        (self.proc / "self" / "mountinfo").write_text(
            "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
            f"23 22 0:5 / {self._escape(self.proc)} rw - proc proc rw\n"
            "24 22 0:6 / /dev rw - devtmpfs udev rw\n" + cgroup_mount
        )
        self.step.mkdir(parents=True)
        self._write(self.step, limit=None, usage=0, inactive_file=0)
        self.set_mem_available(2**40)
        self.set_job_memory(limit=None, usage=0)

    @staticmethod
    def _escape(path: Path) -> str:
        return str(path).replace("\\", "\\134").replace(" ", "\\040")

    def set_mounts(self, mounts: Sequence[Tuple[Union[str, Path], str]]) -> None:
        """``<proc>/self/mounts``, the mount table that ``psutil.disk_partitions`` reads where ``psutil.PROCFS_PATH``
        is :attr:`proc`: a line ``source mountpoint fstype options 0 0`` for each ``(mount point, fstype)``, in order
        (the last of several at one mount point hides the others), with the kernel's escapes."""
        lines = (
            f"src{i} {self._escape(Path(point))} {fstype} rw,relatime 0 0\n" for i, (point, fstype) in enumerate(mounts)
        )
        (self.proc / "self" / "mounts").write_text("".join(lines))

    def set_mem_available(self, available: int) -> None:
        """``MemAvailable`` in ``/proc/meminfo`` (in kB there, as the kernel writes it)."""
        (self.proc / "meminfo").write_text(
            f"MemTotal:       {2 * 2**40 // KIB} kB\nMemFree:        {available // KIB // 2} kB\n"
            f"MemAvailable:   {available // KIB} kB\nBuffers:          1024 kB\n"
        )

    def set_job_memory(self, limit: Optional[int], usage: int, inactive_file: int = 0) -> None:
        """The job cgroup's limit (``None``: none), usage and inactive file cache."""
        self._write(self.job, limit, usage, inactive_file)

    def _write(self, folder: Path, limit: Optional[int], usage: int, inactive_file: int) -> None:
        if self.version == 2:
            (folder / "memory.max").write_text(("max" if limit is None else str(limit)) + "\n")
            (folder / "memory.current").write_text(f"{usage}\n")
            stat = f"anon {usage - inactive_file}\nfile {inactive_file}\ninactive_file {inactive_file}\nactive_file 0\n"
        else:
            (folder / "memory.limit_in_bytes").write_text(f"{V1_UNLIMITED if limit is None else limit}\n")
            (folder / "memory.usage_in_bytes").write_text(f"{usage}\n")
            stat = f"cache {inactive_file}\nrss {usage - inactive_file}\n"
            stat += f"inactive_file 0\ntotal_inactive_file {inactive_file}\n"
        (folder / "memory.stat").write_text(stat)
