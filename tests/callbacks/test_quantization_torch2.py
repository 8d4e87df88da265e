"""``QuantizationAwareTraining(observer_type="average")`` on torch >= 1.12, which renamed the ``version=None`` of
``get_default_qat_qconfig`` to ``version=0`` and rejects ``None`` (``compat/torch112-qat-qconfig-version``)."""
import torch
from torch.ao.quantization import FakeQuantize, FusedMovingAvgObsFakeQuantize

from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import QuantizationAwareTraining
from tests.helpers import BoringModel


def test_average_observer_uses_fake_quantize(tmp_path):
    seen = {}

    class Model(BoringModel):
        def on_train_start(self):
            seen["activation"] = self.qconfig.activation()

        def configure_optimizers(self):
            return torch.optim.SGD(self.layer.parameters(), lr=0.1)

    qat = QuantizationAwareTraining(qconfig="fbgemm", observer_type="average")
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        callbacks=[qat],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    model = Model()
    trainer.fit(model)
    # the plain FakeQuantize that version=None chose, not the fused observer of version=1
    assert type(seen["activation"]) is FakeQuantize
    assert not isinstance(seen["activation"], FusedMovingAvgObsFakeQuantize)
