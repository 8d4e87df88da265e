"""``LightningModule.tbptt_split_batch`` on Python >= 3.10, which removed the ``collections.Sequence`` alias
(``compat/python310-collections-abc``)."""
import torch

from fsdp_harness.scenario import quiet_trainer_kwargs
from pytorch_lightning import Trainer
from tests.helpers import BoringModel


def test_tbptt_split_batch_of_tensors_and_sequences():
    x = torch.arange(2 * 5).view(2, 5)
    names = [["a", "b", "c", "d", "e"], ["f", "g", "h", "i", "j"]]  # a sequence per sample, time along it
    splits = BoringModel().tbptt_split_batch([x, names], split_size=2)
    assert len(splits) == 3
    assert torch.equal(splits[0][0], x[:, 0:2]) and torch.equal(splits[2][0], x[:, 4:5])
    assert splits[0][1] == [["a", "b"], ["f", "g"]]
    assert splits[2][1] == [["e"], ["j"]]


class TBPTTModel(BoringModel):
    def __init__(self):
        super().__init__()
        self.truncated_bptt_steps = 2
        self.split_shapes = []

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 6, 32)), batch_size=2)

    def training_step(self, batch, batch_idx, hiddens):
        (x,) = batch
        self.split_shapes.append(tuple(x.shape))
        loss = self.layer(x).sum()
        return {"loss": loss, "hiddens": hiddens}

    def training_epoch_end(self, outputs):
        pass


def test_fit_with_truncated_bptt(tmp_path):
    model = TBPTTModel()
    trainer = Trainer(**quiet_trainer_kwargs(tmp_path, 1, max_epochs=1, limit_val_batches=0))
    trainer.fit(model)
    # 2 batches of 6 time steps, in splits of 2
    assert model.split_shapes == [(2, 2, 32)] * 6
