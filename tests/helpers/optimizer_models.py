"""``BoringModel`` with one plain optimizer instead of SGD plus a ``StepLR`` scheduler, for checkpoint tests."""
import torch

from tests.helpers.boring_model import BoringModel


class SGDModel(BoringModel):
    """``BoringModel`` without its scheduler: a checkpoint with the model and the (stateless) optimizer only."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


class AdamModel(BoringModel):
    """Adam keeps tensors in the optimizer state, so a resume has optimizer tensors to restore."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.layer.parameters(), lr=0.01)
