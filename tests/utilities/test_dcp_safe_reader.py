"""The converter's DCP reader (``--from dcp``) refuses pickles that name anything DCP's own files never need, before
they run."""
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pytorch_lightning.utilities.dcp_safe_reader import _SafeFileSystemReader, _SafeLoadPlanner
from torch.distributed.checkpoint import CheckpointException


def _save(directory) -> dict:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optim": {"param_groups": optimizer.state_dict()["param_groups"]}}
    dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    return state


def _load(directory) -> dict:
    template = {"model": {k: torch.zeros(s) for k, s in (("weight", (3, 4)), ("bias", (3,)))}, "optim": {}}
    template["optim"] = {"param_groups": [{"lr": None}]}
    dcp.load(template, storage_reader=_SafeFileSystemReader(str(directory)), planner=_SafeLoadPlanner(), no_dist=True)
    return template


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PAYLOAD_RAN",))


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_a_dcp_directory_loads_through_the_safe_reader(tmp_path):
    saved = _save(tmp_path / "ckpt")
    loaded = _load(tmp_path / "ckpt")
    assert torch.equal(loaded["model"]["weight"], saved["model"]["weight"])
    assert loaded["optim"]["param_groups"][0]["lr"] == 0.1


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_a_payload_in_the_metadata_is_refused_and_never_runs(tmp_path, monkeypatch):
    _save(tmp_path / "ckpt")
    metadata = tmp_path / "ckpt" / ".metadata"
    original = pickle.loads(metadata.read_bytes())
    original.storage_meta = _Payload()
    metadata.write_bytes(pickle.dumps(original))
    monkeypatch.chdir(tmp_path)
    # DCP wraps what its steps raise; the converter raises the refusal itself (``_root_cause``)
    with pytest.raises(CheckpointException, match="names `(posix|os).system`, which a DCP checkpoint's metadata never"):
        _load(tmp_path / "ckpt")
    assert not (tmp_path / "PAYLOAD_RAN").exists()


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_a_payload_in_a_param_group_is_refused_and_never_runs(tmp_path, monkeypatch):
    model = torch.nn.Linear(4, 3)
    state = {"model": model.state_dict(), "optim": {"param_groups": [{"lr": _Payload()}]}}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointException, match="'optim.param_groups.0.lr' needs more than tensors"):
        _load(tmp_path / "ckpt")
    assert not (tmp_path / "PAYLOAD_RAN").exists()


_NEW = b"torch.distributed.checkpoint.metadata\n"
_OLD = b"torch.distributed._shard.sharded_tensor.metadata\n"


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
@pytest.mark.parametrize(
    "written_by, renames",
    [
        # Python 3.13's pathlib is a package
        ("python 3.13", [(b"pathlib\nPosixPath\n", b"pathlib._local\nPosixPath\n")]),
        # torch < 2.2 pickled TensorProperties, and its memory format, from the sharded tensor's module
        (
            "torch < 2.2",
            [(_NEW + b"TensorProperties\n", _OLD + b"TensorProperties\n"),
             (_NEW + b"_MEM_FORMAT_ENCODING\n", _OLD + b"MEM_FORMAT_ENCODING\n")],
        ),
    ],
)
def test_metadata_written_by_other_versions_loads(tmp_path, written_by, renames):
    """The same classes pickled under the names other versions give them: the metadata's pickle (protocol 2, whose
    globals are ``module\\nname`` lines) is rewritten as they write it, and still loads."""
    from pathlib import Path

    from torch.distributed.checkpoint.metadata import StorageMeta

    saved = _save(tmp_path / "ckpt")
    metadata = tmp_path / "ckpt" / ".metadata"
    original = pickle.loads(metadata.read_bytes())
    original.storage_meta = StorageMeta(checkpoint_id=Path(tmp_path / "ckpt"))
    data = pickle.dumps(original, protocol=2)
    for new, old in renames:
        assert b"c" + new in data, (written_by, new)
        data = data.replace(b"c" + new, b"c" + old)
    metadata.write_bytes(data)
    loaded = _load(tmp_path / "ckpt")
    assert torch.equal(loaded["model"]["weight"], saved["model"]["weight"]), written_by


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
@pytest.mark.parametrize("where", ["absolute", "parent", "symlink"])
def test_metadata_that_points_outside_its_directory_is_refused(tmp_path, where):
    """A ``.metadata`` whose data file lies elsewhere on the machine (another checkpoint's, here), by its path or
    through a symbolic link in the directory (a tarball can carry one), would have the reader copy that file's tensors
    into the converted checkpoint: refused."""
    _save(tmp_path / "secret")
    _save(tmp_path / "ckpt")
    metadata = tmp_path / "ckpt" / ".metadata"
    original = pickle.loads(metadata.read_bytes())
    (data_file,) = (tmp_path / "secret").glob("*.distcp")
    if where == "symlink":
        (own,) = (tmp_path / "ckpt").glob("*.distcp")
        own.unlink()
        own.symlink_to(data_file)
    for info in original.storage_data.values():
        if where != "symlink":
            info.relative_path = str(data_file) if where == "absolute" else f"../secret/{data_file.name}"
    metadata.write_bytes(pickle.dumps(original))
    with pytest.raises(CheckpointException, match="points at the data file .*, outside its directory or a symbolic"):
        _load(tmp_path / "ckpt")
