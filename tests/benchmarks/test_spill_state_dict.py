"""The benchmark's spilled state dict (``spill-save``): correct checkpoints, file-backed while written, and no spill
file or mapping left behind after a save, a failed write or a failed spill. The 2-rank runs are in
``spill_scenarios.py``; the benchmark smoke test runs ``spill-save`` end to end as well."""
import gc
import io
import os
import sys

import pytest
import torch

from benchmarks.spill_state_dict import SpillFile
from tests.helpers.multiprocess import run_module
from tests.helpers.scenario import read_results

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps; POSIX only")

SCENARIOS = "tests.benchmarks.spill_scenarios"


def _spill_maps(directory) -> int:
    with open("/proc/self/maps") as f:
        return sum(f"{directory}{os.sep}.spill-" in line for line in f)


def test_spill_file_is_unlinked_and_tensors_round_trip(tmp_path):
    spill = SpillFile(str(tmp_path))
    sources = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.tensor([True, False]), torch.randn(1000)]
    targets = spill.allocate(sources) + spill.allocate([torch.randn(2, 2, dtype=torch.float64)])
    for target, source in zip(targets, sources):
        target.copy_(source)
    spill.close()
    assert os.listdir(tmp_path) == []  # unlinked as soon as it was created
    assert _spill_maps(tmp_path) == 2  # one mapping per allocation, of the deleted file
    assert [t.shape for t in targets[:4]] == [s.shape for s in sources]
    buffer = io.BytesIO()
    torch.save(targets[:4], buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert all(torch.equal(a, b) and a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
               for a, b in zip(loaded, sources))
    del targets, target
    gc.collect()
    assert _spill_maps(tmp_path) == 0  # the mappings live exactly as long as the tensors


def test_nothing_to_spill_creates_no_file(tmp_path):
    spill = SpillFile(str(tmp_path))
    assert spill.allocate([]) == []
    spill.close()
    assert os.listdir(tmp_path) == [] and spill.spilled_bytes == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", ["save", "write_fails", "spill_fails"])
def test_spill_save_on_two_ranks(tmp_path, scenario):
    result = run_module(SCENARIOS, [scenario, "--out", str(tmp_path)], timeout=240)
    assert not result.timed_out, result.output[-8000:]
    assert result.returncode == 0, result.output[-8000:]
    rank0, rank1 = read_results(tmp_path, 2)
    for rank in (rank0, rank1):
        assert rank["names_after"] == []  # no spill file left, whatever happened
        assert rank["spill_maps_after"] == 0  # and no page of it still mapped
    assert rank1["spilled_bytes"] == 0  # ranks that keep no state dict spill nothing
    if scenario == "spill_fails":
        assert "could not spill the state dict" in rank0["error"] and "injected: no space left" in rank0["error"]
        assert rank1["error"] and "failed on global rank 0" in rank1["error"]
        return
    assert rank0["names_during_write"] == []  # never visible under a name, even while written
    assert rank0["spill_maps_during_write"] == 3  # one mapping per FSDP unit: the state dict is file-backed
    assert rank0["spilled_bytes"] == 3 * (16 * 16 + 16) * 4  # every unit, not the plain parameters outside FSDP
    if scenario == "write_fails":
        assert "injected: no space left" in rank0["error"] and "injected: no space left" in rank1["error"]
        assert not (tmp_path / "model.ckpt").exists()
        return
    assert rank0["error"] is None and rank1["error"] is None
    assert rank0["keys_match"] and rank0["values_equal"]
