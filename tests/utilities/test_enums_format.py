"""Lightning's enums format as their value on every Python, as they did before Python 3.11."""
from pytorch_lightning import Trainer
from pytorch_lightning.trainer.states import RunningStage, TrainerFn
from pytorch_lightning.utilities.enums import PrecisionType
from tests.helpers import BoringModel


def test_enum_formats_as_its_value():
    assert f"{TrainerFn.FITTING}" == "fit"
    assert "{}_loop".format(TrainerFn.VALIDATING) == "validate_loop"
    assert f"run_{RunningStage.SANITY_CHECKING}_evaluation" == "run_sanity_check_evaluation"
    assert f"{PrecisionType.HALF:>4}" == "  16"
    # only formatting changes: equality, hashing and repr stay as they were
    assert TrainerFn.FITTING == "fit" and hash(TrainerFn.FITTING) == hash("fit")
    assert repr(TrainerFn.FITTING) == "<TrainerFn.FITTING: 'fit'>"


def test_profiler_names_the_stage(tmp_path):
    """Lightning names profiled actions after the running stage, e.g. ``run_validate_evaluation``."""
    trainer = Trainer(default_root_dir=tmp_path, logger=False, profiler="simple", limit_val_batches=1)
    trainer.validate(BoringModel(), verbose=False)
    assert "run_validate_evaluation" in trainer.profiler.recorded_durations
