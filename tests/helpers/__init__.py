from tests.helpers.boring_model import BoringDataModule, BoringModel, RandomDataset  # noqa: F401
