"""The CRC-32 of every zip record of a checkpoint file, written by every FSDP save path.

``torch.save`` puts each record's CRC-32 in its data descriptor and in its central-directory entry. A streamed save
writes the file's structure with ``torch.serialization.skip_data``, which leaves 0 there for every tensor record
(``archive/data/N``), and the tensors' bytes later, from global rank 0 or from every rank: the fork computes the
CRC-32 of each piece as it is written, combines them per record on global rank 0 and writes them into both places
before the file is committed (``pytorch_lightning/utilities/checkpoint_crc.py``). Without that, ``unzip -t`` and
``zipfile.ZipFile.testzip`` report the file damaged, and a load cannot tell a damaged record from a good one.

Each save path must write valid CRC-32s, with SGD momentum and with Adam, on the tied-weights model with parameters
outside FSDP at width 72 (FSDP shards end inside records and inside 4 KiB blocks): global rank 0's streamed save
(``checkpoint_writers="rank0"``, 1 and 2 ranks), the parallel save (``"all"``, 1, 2 and 4 ranks), both in the
background (``async_checkpoint=True``, inside ``fit``, 2 ranks) and, as the control, the gathered save
(``stream_checkpoint=False``). Every file is checked three ways: ``testzip``, ``unzip -t`` (where installed) and
``tests/helpers/zip_records.py``, which reads every record's local header and data descriptor with ``struct``, not
with the fork's reader, and compares them and the central directory's CRC-32 with ``zlib.crc32`` of the record's
bytes. Scenarios in ``fsdp_record_crc_scenarios.py`` (real FairScale FSDP on CPU processes over gloo) run in one
batch per world size, launched together: 1 rank, 2 ranks (every path), 4 ranks (the parallel save only).
"""
import struct
import zipfile
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from fsdp_harness.runner import CasePlans, ScenarioBatches
from tests.helpers.zip_records import read_records, record_problems, unzip_test

SCENARIOS = "tests.strategies.fsdp_record_crc_scenarios"
#: one batch per world size, in launch order: ranks and timeout
BATCHES = {"one": (1, 90), "two": (2, 150), "four": (4, 150)}
BATCHES_TIMEOUT = sum(timeout for _, timeout in BATCHES.values()) + 60
#: the saves each batch's cases make (see ``fsdp_record_crc_scenarios.SAVES``)
SAVES = {
    "one": ["rank0", "all", "gathered"],
    "two": ["async-rank0", "async-all", "rank0", "all", "gathered"],
    "four": ["all"],
}
BATCH_OF = {devices: name for name, (devices, _) in BATCHES.items()}
OPTIMIZERS = ["sgd", "adam"]
#: the model's non-empty tensor records, at least: parameters, buffers, metric state, optimizer state
MIN_TENSOR_RECORDS = 20

# the cases each test reads, queued only for the tests this session runs
PLANS = CasePlans()
queues = PLANS.queues


def _case(devices: int, optimizer: str) -> str:
    return f"{BATCH_OF[devices]}-{optimizer}"


def _plan(*world_sizes: int) -> Any:
    def plan(batches: ScenarioBatches) -> None:
        for devices in world_sizes:
            batch = batches.batch(BATCH_OF[devices], devices)
            for optimizer in OPTIMIZERS:
                if _case(devices, optimizer) not in batch:
                    saves = SAVES[BATCH_OF[devices]]
                    batch.add(_case(devices, optimizer), "saves", "--optimizer", optimizer, "--saves", *saves)

    return plan


@pytest.fixture(scope="module")
def crc_runs(request, tmp_path_factory) -> ScenarioBatches:
    return PLANS.queued_batches(request, SCENARIOS, tmp_path_factory.mktemp("record_crcs"), BATCHES)


def _saved(batches: ScenarioBatches, devices: int, optimizer: str, mode: str) -> List[Dict[str, Any]]:
    """What every rank recorded of the save ``mode`` of the case, after checking its file's CRC-32 fields."""
    case = _case(devices, optimizer)
    results = batches.results(case)
    path = batches.folder(case) / f"{mode}.ckpt"
    check_record_crcs(path)
    records, _ = read_records(path)
    assert sum(record.is_tensor and record.size > 0 for record in records) >= MIN_TENSOR_RECORDS
    return [result["saves"][mode] for result in results]


def check_record_crcs(path: Path) -> None:
    """The CRC-32 fields of every record of the file at ``path`` are right: ``testzip`` finds no bad record,
    ``unzip -t`` (where installed) exits 0, and every data descriptor and central-directory entry has the CRC-32 of
    its record's bytes (and a descriptor its size, twice)."""
    with zipfile.ZipFile(path) as archive:
        bad_record = archive.testzip()
    unzip = unzip_test(path)
    found = {
        "testzip": bad_record,
        "unzip -t": unzip.returncode if unzip is not None else 0,
        "records": record_problems(path)[:8],
    }
    expected = {"testzip": None, "unzip -t": 0, "records": []}
    assert found == expected, f"{path.name}:\n" + (unzip.stdout[-2000:] if unzip is not None else "")


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("devices", [1, 2])
@queues(_plan(1, 2))
def test_streamed_save_writes_every_record_crc(crc_runs, devices, optimizer):
    """Global rank 0 writes the structure, then the values of every FSDP unit as it is gathered
    (``checkpoint_writers="rank0"``): every record's CRC-32 is right, the tensor records' included."""
    saved = _saved(crc_runs, devices, optimizer, "rank0")
    assert [s["streamed_files"] for s in saved] == [1] + [0] * (devices - 1), saved
    assert [(s["crc_exchanges"], s["in_background"]) for s in saved] == [(0, False)] * devices, saved


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("devices", [1, 2, 4])
@queues(_plan(1, 2, 4))
def test_parallel_save_writes_every_record_crc(crc_runs, devices, optimizer):
    """Every rank writes its own shards into the file (``checkpoint_writers="all"``) and sends global rank 0 the
    CRC-32s of its pieces, which it combines per record: every record's CRC-32 is right, in a single process too and
    where 4 ranks' shards (and the blocks they own) split the records at many places."""
    saved = _saved(crc_runs, devices, optimizer, "all")
    assert [s["streamed_files"] for s in saved] == [1] + [0] * (devices - 1), saved
    assert [(s["crc_exchanges"], s["in_background"]) for s in saved] == [(1, False)] * devices, saved


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("writers", ["rank0", "all"])
@queues(_plan(2))
def test_async_save_writes_every_record_crc(crc_runs, writers, optimizer):
    """Saved inside ``fit`` with ``async_checkpoint=True``: global rank 0's writer thread writes the file alone
    (``"rank0"``), or every rank's writer thread writes its own shards and sends its CRC-32s from there
    (``"all"``): every record's CRC-32 is right once ``wait_for_checkpoint`` returns."""
    saved = _saved(crc_runs, 2, optimizer, f"async-{writers}")
    assert [s["streamed_files"] for s in saved] == [1, 0], saved
    exchanges = 1 if writers == "all" else 0
    assert [(s["crc_exchanges"], s["in_background"]) for s in saved] == [(exchanges, True)] * 2, saved


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("devices", [1, 2])
@queues(_plan(1, 2))
def test_gathered_save_writes_every_record_crc(crc_runs, devices, optimizer):
    """The control: the gathered save (``stream_checkpoint=False``) is ``torch.save`` of the full state, whose
    CRC-32s were always right; the checks pass on it as on the others."""
    saved = _saved(crc_runs, devices, optimizer, "gathered")
    assert [(s["streamed_files"], s["crc_exchanges"]) for s in saved] == [(0, 0)] * devices, saved


def test_the_check_finds_each_wrong_field(tmp_path):
    """``check_record_crcs`` is not vacuous: on a ``torch.save`` file it passes; a tensor record's CRC-32 changed in
    its descriptor only, or in the central directory only, or a descriptor's size, fails it naming the record."""
    path = tmp_path / "saved.ckpt"
    with open(path, "wb") as f:
        torch.save({"weight": torch.randn(72, 72), "empty": torch.empty(0), "step": torch.tensor(1)}, f)
    check_record_crcs(path)
    records, _ = read_records(path)
    data = path.read_bytes()
    record = next(r for r in records if r.is_tensor and r.size == 72 * 72 * 4)
    with zipfile.ZipFile(path) as archive:
        central_crc_at = _central_entry(data, archive.start_dir, record.name) + 16
    changes = {
        "descriptor CRC-32": (record.descriptor.offset + 4, "<I", record.crc ^ 1),
        "central directory CRC-32": (central_crc_at, "<I", record.crc ^ 1),
        "descriptor sizes": (record.descriptor.offset + 8, "<I", record.size + 1),
    }
    for problem, (offset, layout, value) in changes.items():
        changed = bytearray(data)
        struct.pack_into(layout, changed, offset, value)
        path.write_bytes(bytes(changed))
        assert [p for p in record_problems(path) if problem in p] and all(
            p.startswith(record.name) for p in record_problems(path)
        ), problem
        with pytest.raises(AssertionError, match="saved.ckpt"):
            check_record_crcs(path)


def _central_entry(data: bytes, start: int, name: str) -> int:
    """Where the central-directory entry of the record ``name`` begins."""
    at = start
    while data[at : at + 4] == b"PK\x01\x02":
        name_length, extra_length, comment_length = struct.unpack_from("<HHH", data, at + 28)
        if data[at + 46 : at + 46 + name_length].decode() == name:
            return at
        at += 46 + name_length + extra_length + comment_length
    raise AssertionError(f"{name} is not in the central directory")
