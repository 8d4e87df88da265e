"""The harness's measurement helpers that the checkpoint-memory benchmark's figures and checks rest on: the memory
sampler tells anonymous memory from mapped file pages, and the tensor comparison finds every difference."""
import mmap
import time

import pytest
import torch

from fsdp_harness.memory_sampler import MIB, PeakMemory
from fsdp_harness.tensor_compare import compare_tensors

SIZE = 16 * MIB


def test_mapped_file_pages_count_as_file_not_anonymous(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"\1" * SIZE)
    with open(path, "rb") as f, PeakMemory() as meter:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            assert sum(mapped[i] for i in range(0, SIZE, mmap.PAGESIZE)) == SIZE // mmap.PAGESIZE
            time.sleep(0.1)  # the sampler thread reads every few ms; let it see the pages while they are mapped
    result = meter.result()
    assert result["peak_extra_file_mb"] > 0.9 * SIZE / MIB
    assert result["peak_extra_anon_file_mb"] > 0.9 * SIZE / MIB
    assert result["peak_extra_mb"] < 0.25 * SIZE / MIB
    assert "cuda_max_allocated_mb" not in result


def test_anonymous_memory_counts_as_anonymous():
    with PeakMemory() as meter:
        block = torch.ones(SIZE // 4)
        time.sleep(0.1)
        del block
    result = meter.result()
    assert result["peak_extra_mb"] > 0.9 * SIZE / MIB
    assert result["peak_extra_anon_file_mb"] > 0.9 * SIZE / MIB
    assert result["peak_extra_file_mb"] < 0.25 * SIZE / MIB


def test_compare_tensors_walks_nested_state():
    state = {
        "state_dict": {"a.weight": torch.ones(3)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(2), "step": torch.tensor(3.0)}}}],
    }
    same = {"state_dict": {"a.weight": torch.ones(3)}, "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(2),
                                                                                          "step": torch.tensor(3.0)}}}]}
    assert compare_tensors(state, same) == {"compared": 3, "mismatched": [], "ok": True}

    same["optimizer_states"][0]["state"][0]["exp_avg"][1] = 1e-30
    same["state_dict"]["a.weight"] = torch.ones(3, dtype=torch.float64)
    same["optimizer_states"][0]["state"][0]["exp_avg_sq"] = torch.zeros(2)
    result = compare_tensors(state, same)
    assert result["compared"] == 3 and not result["ok"]
    assert sorted(result["mismatched"]) == [
        "optimizer_states/0/state/0/exp_avg", "optimizer_states/0/state/0/exp_avg_sq", "state_dict/a.weight"
    ]


@pytest.mark.parametrize("shape, equal", [((4,), True), ((2, 2), False), ((1, 4), False)])
def test_compare_tensors_sees_shape(shape, equal):
    assert compare_tensors({"t": torch.zeros(4)}, {"t": torch.zeros(shape)})["ok"] is equal
