"""The host memory a process can still allocate, from fake ``/proc`` and cgroup files (``tests/helpers/fake_proc.py``):
the tighter of ``MemAvailable`` and each memory cgroup's limit minus its usage, and the needs of the processes under
one bound added up; what torch's pinned allocator takes for a pinned buffer."""
import pytest

from pytorch_lightning.utilities.host_memory import (
    host_memory_bounds,
    MemoryBound,
    overcommitted_bound,
    pinned_host_bytes,
)
from tests.helpers.fake_proc import FakeProc

GIB = 2**30


@pytest.mark.parametrize(
    "version, mount_root", [(2, "/"), (1, "/"), (1, "/job_1")], ids=["v2", "v1", "v1-container"]
)
def test_cgroup_limit_minus_usage_is_the_tighter_bound(tmp_path, version, mount_root):
    """A 256 GiB job on a 2 TiB host: ``MemAvailable`` says 1.5 TiB, the job's cgroup 256 GiB minus what it uses,
    not counting its inactive file cache (reclaimed first). The step's cgroup, inside the job's, has no limit."""
    fake = FakeProc(tmp_path, version=version, mount_root=mount_root)
    fake.set_mem_available(1536 * GIB)
    fake.set_job_memory(limit=256 * GIB, usage=200 * GIB, inactive_file=50 * GIB)
    bounds = host_memory_bounds(str(fake.proc))
    assert [b.available for b in bounds] == [1536 * GIB, 106 * GIB]
    assert bounds[0].key == ("host", "fake-boot-id")
    assert bounds[1].key[:2] == ("cgroup", "fake-boot-id") and str(fake.job) in bounds[1].description
    assert min(b.available for b in bounds) == 106 * GIB


def test_no_cgroup_limit(tmp_path):
    """Without a limit (cgroup v2 ``max``, v1's ``PAGE_COUNTER_MAX`` pages) only ``MemAvailable`` bounds."""
    for version in (1, 2):
        fake = FakeProc(tmp_path / f"v{version}", version=version)
        fake.set_mem_available(64 * GIB)
        expected = MemoryBound(("host", "fake-boot-id"), "the host's `MemAvailable`", 64 * GIB)
        assert host_memory_bounds(str(fake.proc)) == [expected]


def test_limit_on_the_innermost_cgroup_and_more_used_than_allowed(tmp_path):
    """Limits on several levels each bound; usage above a limit (possible for a while) leaves nothing."""
    fake = FakeProc(tmp_path)
    fake.set_job_memory(limit=8 * GIB, usage=9 * GIB)
    (fake.step / "memory.max").write_text(f"{4 * GIB}\n")
    (fake.step / "memory.current").write_text(f"{GIB}\n")
    assert [b.available for b in host_memory_bounds(str(fake.proc))] == [2**40, 3 * GIB, 0]


def test_paths_with_spaces_and_missing_files(tmp_path):
    fake = FakeProc(tmp_path / "with space")
    fake.set_job_memory(limit=2 * GIB, usage=GIB)
    assert [b.available for b in host_memory_bounds(str(fake.proc))] == [2**40, GIB]
    (fake.proc / "self" / "mountinfo").unlink()
    assert [b.available for b in host_memory_bounds(str(fake.proc))] == [2**40]
    (fake.proc / "meminfo").unlink()
    assert host_memory_bounds(str(fake.proc)) == []
    assert host_memory_bounds(str(tmp_path / "no-proc-here")) == []


def test_needs_add_up_under_each_bound():
    host_a, host_b = ("host", "a"), ("host", "b")
    cgroup_1, cgroup_2 = ("cgroup", "a", 1, 10), ("cgroup", "a", 1, 11)

    def bound(key, available):
        return MemoryBound(key, f"bound {key}", available)

    # 8 ranks of one node, each needing 40 GiB, under the node's 256 GiB job cgroup: 320 GiB needed
    node = [(40 * GIB, [bound(host_a, 1800 * GIB), bound(cgroup_1, 256 * GIB)]) for _ in range(8)]
    short, ranks, needed = overcommitted_bound(node)
    assert short.key == cgroup_1 and ranks == list(range(8)) and needed == 320 * GIB
    # the same ranks spread over two hosts fit
    spread = [(40 * GIB, [bound(host_a if i < 4 else host_b, 200 * GIB)]) for i in range(8)]
    assert overcommitted_bound(spread) is None
    # one container per rank on one host: each within its own limit, and the host has room for all of them
    containers = [(40 * GIB, [bound(host_a, 400 * GIB), bound(cgroup, 50 * GIB)]) for cgroup in (cgroup_1, cgroup_2)]
    assert overcommitted_bound(containers) is None
    # the lowest reading of a shared bound counts; ranks that need nothing report no bounds
    readings = [(60, [bound(host_a, 100)]), (30, [bound(host_a, 80)]), (0, [])]
    assert overcommitted_bound(readings) == (bound(host_a, 80), [0, 1], 90)


def test_pinned_buffers_take_the_next_power_of_two():
    """torch's ``CachingHostAllocator`` rounds each pinned block up to a power of two (checked against torch's own
    allocator by ``tools/gpu_check.sh``): a shard a little over 1 GiB takes 2 GiB."""
    assert [pinned_host_bytes(n) for n in (0, 1, 2, 3, 4, 5, 4096, 4097)] == [0, 1, 2, 4, 4, 8, 4096, 8192]
    assert pinned_host_bytes(GIB) == GIB and pinned_host_bytes(GIB + 1) == 2 * GIB
    # a 7B-parameter model's fp32 shard on 8 ranks: 3.26 GiB, pinned in 4 GiB
    assert pinned_host_bytes(7 * 10**9 * 4 // 8) == 4 * GIB
