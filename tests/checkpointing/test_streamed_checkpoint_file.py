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
