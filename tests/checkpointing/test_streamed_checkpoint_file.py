"""``_StreamedCheckpointFile``: a checkpoint whose structure is written first and whose pending tensors' values are
written into their place later (the file behind ``DDPFullyShardedStrategy(stream_checkpoint=True)``)."""
import os

import pytest
import torch

from pytorch_lightning.utilities.streamed_checkpoint_file import (
    _NotStreamable,
    _StreamedCheckpointFile,
    _streamed_save_available,
)

pytestmark = pytest.mark.skipif(not _streamed_save_available(), reason="needs torch >= 2.5")


def fake_tensors(*shapes, dtype=torch.float32):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return [torch.empty(shape, dtype=dtype) for shape in shapes]


def test_pending_tensors_are_written_in_place(tmp_path):
    weight, flat = fake_tensors((3, 4), (10,))
    views = [flat[:4].view(2, 2), flat[4:]]  # views of one pending storage, as the optimizer state's
    real = torch.arange(6.0)
    checkpoint = {
        "state_dict": {
            "weight": weight,
            "real": real,
            "real_view": real[2:4],
            "bf16": torch.ones(3, dtype=torch.bfloat16),
        },
        "optimizer_states": [{"state": {0: {"momentum": views[0]}, 1: {"momentum": views[1]}}, "step": 3}],
        "hyper_parameters": {"lr": 0.1},
    }
    path = tmp_path / "model.ckpt"
    path.write_bytes(b"previous")
    writer = _StreamedCheckpointFile(path, flush_bytes=16)
    writer.write_skeleton(checkpoint, [weight, flat])
    assert path.read_bytes() == b"previous"  # nothing is published before ``commit``
    writer.write(weight, torch.full((3, 4), 2.0))
    writer.write(flat, torch.arange(4.0), element_offset=0)  # in two parts, as ranks' shards arrive
    writer.write(flat, torch.arange(4.0, 10.0), element_offset=4)
    writer.commit()
    assert sorted(os.listdir(tmp_path)) == ["model.ckpt"]

    for loaded in (torch.load(path, weights_only=False, mmap=True), torch.load(path, weights_only=True)):
        assert torch.equal(loaded["state_dict"]["weight"], torch.full((3, 4), 2.0))
        assert torch.equal(loaded["state_dict"]["real"], real)
        assert torch.equal(loaded["state_dict"]["real_view"], real[2:4])
        assert torch.equal(loaded["state_dict"]["bf16"], torch.ones(3, dtype=torch.bfloat16))
        state = loaded["optimizer_states"][0]["state"]
        assert torch.equal(state[0]["momentum"], torch.arange(4.0).view(2, 2))
        assert torch.equal(state[1]["momentum"], torch.arange(4.0, 10.0))
        assert loaded["optimizer_states"][0]["step"] == 3 and loaded["hyper_parameters"] == {"lr": 0.1}


def test_discard_leaves_the_previous_file(tmp_path):
    (weight,) = fake_tensors((4,))
    path = tmp_path / "model.ckpt"
    path.write_bytes(b"previous")
    writer = _StreamedCheckpointFile(path)
    writer.write_skeleton({"state_dict": {"weight": weight}}, [weight])
    writer.discard()
    assert path.read_bytes() == b"previous"
    assert sorted(os.listdir(tmp_path)) == ["model.ckpt"]


class Holder:
    def __init__(self, tensor):
        self.tensor = tensor


@pytest.mark.parametrize("case", ["hidden_tensor", "missing_pending"])
def test_unreachable_tensors_are_not_streamable(tmp_path, case):
    """A tensor inside another object could not be written, and a pending tensor absent from the checkpoint would
    never be: both are refused before any value is written, so the caller saves the checkpoint whole instead."""
    weight, other = fake_tensors((4,), (2,))
    checkpoint = {"state_dict": {"weight": weight}}
    if case == "hidden_tensor":
        checkpoint["callbacks"] = {"cb": Holder(torch.ones(2))}
    writer = _StreamedCheckpointFile(tmp_path / "model.ckpt")
    with pytest.raises(_NotStreamable):
        writer.write_skeleton(checkpoint, [weight] + ([other] if case == "missing_pending" else []))
    writer.discard()
    assert os.listdir(tmp_path) == []


def test_a_close_that_reports_an_error_fails_the_commit_and_is_not_repeated(tmp_path, monkeypatch):
    """NFS and FUSE report a delayed write error (``EDQUOT``) at ``close``, which has released the descriptor all the
    same: the commit fails, the previous file stays, and the discard that follows closes nothing more (another
    thread may hold that descriptor's number by then)."""
    import errno

    (weight,) = fake_tensors((3, 4))
    path = tmp_path / "model.ckpt"
    path.write_bytes(b"previous")
    writer = _StreamedCheckpointFile(path)
    writer.write_skeleton({"state_dict": {"weight": weight}}, [weight])
    writer.write(weight, torch.ones(3, 4))
    fd, real_close, closed = writer.fileno(), os.close, []

    def close(number: int) -> None:
        real_close(number)
        closed.append(number)
        if number == fd:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(os, "close", close)
    with pytest.raises(OSError, match="Disk quota exceeded"):
        writer.commit()
    monkeypatch.undo()
    assert closed.count(fd) == 1
    assert path.read_bytes() == b"previous" and sorted(os.listdir(tmp_path)) == ["model.ckpt"]


@pytest.mark.parametrize("whole_file", [True, False])
def test_a_writer_drops_what_it_wrote_from_the_page_cache(tmp_path, monkeypatch, whole_file):
    """The file's only writer (a streamed file) advises the whole file at each flush, so chunks still under
    writeback at their own flush go at a later one; a rank of a parallel save advises the span it wrote since its last
    flush (its shards lie between the other ranks')."""
    from pytorch_lightning.utilities.local_file_storage import _LocalFileWriter

    advised = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: advised.append((offset, length)))
    with open(tmp_path / "file", "wb") as f:
        writer = _LocalFileWriter(f.fileno(), fsync_chunks=False, flush_bytes=64, whole_file=whole_file)
        for offset in (128, 192, 1024, 1088):
            writer.write(torch.ones(64, dtype=torch.uint8), offset)
    assert advised == ([(0, 0)] * 4 if whole_file else [(128, 64), (192, 64), (1024, 64), (1088, 64)])
