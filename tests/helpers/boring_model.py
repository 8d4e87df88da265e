"""A minimal LightningModule and data, under the names Lightning's own tests use, so test files port unchanged."""
from typing import Any, Dict, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from pytorch_lightning import LightningDataModule, LightningModule


class RandomDataset(Dataset):
    """``length`` random vectors of width ``size``."""

    def __init__(self, size: int, length: int) -> None:
        self.len = length
        self.data = torch.randn(length, size)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return self.len


class BoringModel(LightningModule):
    """One linear layer trained towards zero output: enough to exercise every loop hook cheaply.

    Subclass and override what a test needs; ``self.layer`` is the only parameterised module.
    """

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def loss(self, batch: torch.Tensor, prediction: torch.Tensor) -> torch.Tensor:
        # The target is all ones; any differentiable scalar would do.
        return torch.nn.functional.mse_loss(prediction, torch.ones_like(prediction))

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        return self.loss(batch, self(batch))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> Dict[str, torch.Tensor]:
        return {"loss": self.step(batch)}

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> Dict[str, torch.Tensor]:
        loss = self.step(batch)
        self.log("val_loss", loss)
        return {"x": loss}

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> Dict[str, torch.Tensor]:
        loss = self.step(batch)
        self.log("test_loss", loss)
        return {"y": loss}

    def predict_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: Optional[int] = None) -> Any:
        return self(batch)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        return [optimizer], [scheduler]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64))

    def test_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64))

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64))


class BoringDataModule(LightningDataModule):
    """Random train/val/test/predict splits of width 32."""

    def __init__(self) -> None:
        super().__init__()
        self.data = RandomDataset(32, 64 * 4)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.utils.data.Subset(self.data, range(0, 64)))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(torch.utils.data.Subset(self.data, range(64, 128)))

    def test_dataloader(self) -> DataLoader:
        return DataLoader(torch.utils.data.Subset(self.data, range(128, 192)))

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(torch.utils.data.Subset(self.data, range(192, 256)))
