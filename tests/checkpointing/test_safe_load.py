"""Safe checkpoint loading (the fork/safe-checkpoint-load patch): no load path runs code from a checkpoint unless the
user asks for it; what Lightning itself writes into checkpoints still loads by default."""
import argparse
import http.server
import os
import pickle
import runpy
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

from fsdp_harness.runner import run_scenario
from fsdp_harness.scenario import quiet_trainer_kwargs
from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.utilities import safe_load
from pytorch_lightning.utilities.cloud_io import load as pl_load
from pytorch_lightning.utilities.enums import PrecisionType
from pytorch_lightning.utilities.exceptions import CheckpointError
from pytorch_lightning.utilities.parsing import AttributeDict
from tests.helpers import BoringModel, RandomDataset
from tests.helpers.malicious_checkpoint import make_malicious_checkpoint

pytestmark = pytest.mark.skipif(not safe_load._SAFE_GLOBALS_AVAILABLE, reason="needs torch.serialization.safe_globals")


def _trainer(tmp_path, **kwargs):
    defaults = dict(max_epochs=1, limit_train_batches=2, limit_val_batches=0)
    return Trainer(**quiet_trainer_kwargs(tmp_path, 1, **{**defaults, **kwargs}))


class HParamsModel(BoringModel):
    def __init__(self, hparams=None, **kwargs):
        super().__init__()
        self.save_hyperparameters(hparams if hparams is not None else kwargs)


@pytest.fixture
def malicious(tmp_path):
    """(checkpoint path, marker path): an ordinary checkpoint whose unpickling would create the marker."""
    trainer = _trainer(tmp_path)
    trainer.fit(BoringModel())
    good = tmp_path / "good.ckpt"
    trainer.save_checkpoint(good)
    bad, marker = tmp_path / "bad.ckpt", tmp_path / "PAYLOAD_RAN"
    make_malicious_checkpoint(good, bad, marker)
    return bad, marker


def _assert_refused(error: BaseException, path) -> None:
    assert isinstance(error, CheckpointError) and isinstance(error, pickle.UnpicklingError), type(error)
    message = str(error)
    assert "posix.system" in message and str(path) in message, message
    assert "weights_only=False" in message and "torch.serialization.add_safe_globals([posix.system])" in message


class _Server:
    """Serves ``folder`` on 127.0.0.1 for the URL load path."""

    def __init__(self, folder: Path) -> None:
        handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(folder), **k)  # noqa: E731
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


LOADERS = {
    "cloud_io.load": lambda path, **kw: pl_load(str(path), **kw),
    "cloud_io.load(file object)": lambda path, **kw: pl_load(open(path, "rb"), **kw),
    "TorchCheckpointIO (mmap)": lambda path, **kw: TorchCheckpointIO().load_checkpoint(path),
    "load_from_checkpoint": lambda path, **kw: BoringModel.load_from_checkpoint(str(path), **kw),
}


@pytest.mark.parametrize("loader", LOADERS)
def test_malicious_checkpoint_is_refused(malicious, loader):
    bad, marker = malicious
    with pytest.raises(CheckpointError) as info:
        LOADERS[loader](bad)
    assert not marker.exists(), "the payload ran"
    _assert_refused(info.value, "bad.ckpt" if "file object" not in loader else "a file object")


@pytest.mark.parametrize("fn", ["fit", "validate", "test", "predict"])
def test_malicious_checkpoint_is_refused_by_the_trainer(tmp_path, malicious, fn):
    bad, marker = malicious
    with pytest.raises(CheckpointError, match="Loading the checkpoint from .*bad.ckpt.* failed") as info:
        getattr(_trainer(tmp_path), fn)(BoringModel(), ckpt_path=str(bad))
    assert not marker.exists()
    _assert_refused(info.value, bad)


def test_malicious_checkpoint_from_a_url(tmp_path, malicious, monkeypatch):
    bad, marker = malicious
    torch.hub.set_dir(str(tmp_path / "hub"))
    with _Server(tmp_path) as url:
        with pytest.raises(CheckpointError) as info:
            pl_load(f"{url}/bad.ckpt")
        assert not marker.exists()
        _assert_refused(info.value, f"{url}/bad.ckpt")
        with pytest.raises(CheckpointError, match="Loading the checkpoint from"):
            _trainer(tmp_path).fit(BoringModel(), ckpt_path=f"{url}/bad.ckpt")
        assert not marker.exists()
        # the explicit opt-out loads it, payload and all (the hub caches the download)
        assert pl_load(f"{url}/bad.ckpt", weights_only=False)["callbacks"]["Innocent"]["payload"] == 0
    assert marker.exists()


@pytest.mark.parametrize("opt_out", ["argument", "environment"])
@pytest.mark.parametrize("loader", ["cloud_io.load", "load_from_checkpoint", "fit"])
def test_opt_out_loads_the_file_and_warns_once(tmp_path, malicious, monkeypatch, opt_out, loader):
    bad, marker = malicious
    monkeypatch.setattr(safe_load, "_warned", set())
    kwargs = {"weights_only": False} if opt_out == "argument" else {}
    if opt_out == "environment":
        monkeypatch.setenv("PL_UNSAFE_CHECKPOINT_LOAD", "1")
    with pytest.warns(UserWarning, match="`weights_only=False` unpickles them fully") as record:
        if loader == "fit":
            _trainer(tmp_path, max_epochs=2).fit(BoringModel(), ckpt_path=str(bad), **kwargs)
        else:
            LOADERS[loader](bad, **kwargs)
        LOADERS["cloud_io.load"](bad, weights_only=False)
    assert marker.exists()
    assert sum("unpickles them fully" in str(w.message) for w in record) == 1


def test_explicit_weights_only_true_wins_over_the_environment(malicious, monkeypatch):
    bad, marker = malicious
    monkeypatch.setenv("PL_UNSAFE_CHECKPOINT_LOAD", "1")
    with pytest.raises(CheckpointError):
        pl_load(str(bad), weights_only=True)
    assert not marker.exists()


def test_allowing_the_type_loads_the_file(tmp_path):
    trainer = _trainer(tmp_path)
    model = HParamsModel(extra=argparse.ArgumentParser)  # a class, which no allow-list has
    trainer.fit(model)
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    with pytest.raises(CheckpointError, match="argparse.ArgumentParser"):
        HParamsModel.load_from_checkpoint(str(path))
    with torch.serialization.safe_globals([argparse.ArgumentParser]):
        assert HParamsModel.load_from_checkpoint(str(path)).hparams.extra is argparse.ArgumentParser


HPARAMS = {
    "plain": dict(lr=0.1, name="x", sizes=[1, 2], nested={"a": (1, 2.5)}),
    "namespace": argparse.Namespace(lr=0.1, inner=argparse.Namespace(depth=2)),
    "attribute dict": AttributeDict(lr=0.1, inner={"depth": 2}),
    "lightning enum": dict(precision=PrecisionType.HALF),
}


@pytest.mark.parametrize("kind", HPARAMS)
def test_lightning_checkpoints_load_by_default(tmp_path, kind):
    """Hyperparameters of the types Lightning saves, two optimizers with LR schedulers, ModelCheckpoint and
    EarlyStopping state: resumed, loaded with load_from_checkpoint and with cloud_io.load, all by default."""
    from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint

    class TwoOptimizers(HParamsModel):
        def training_step(self, batch, batch_idx, optimizer_idx=0):
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            out = super().validation_step(batch, batch_idx)
            self.log("val_loss", out["x"])

        def configure_optimizers(self):
            sgd = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            adam = torch.optim.Adam(self.parameters(), lr=0.01)
            plateau = {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(adam), "monitor": "val_loss"}
            return [sgd, adam], [torch.optim.lr_scheduler.StepLR(sgd, 1), plateau]

    def make_trainer(**kwargs):
        callbacks = [ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_last=True), EarlyStopping("val_loss")]
        return _trainer(tmp_path, limit_val_batches=1, enable_checkpointing=True, callbacks=callbacks, **kwargs)

    trainer = make_trainer()
    trainer.fit(TwoOptimizers(HPARAMS[kind]))
    path = tmp_path / "last.ckpt"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*unpickles them fully")
        checkpoint = pl_load(str(path))
        loaded = TwoOptimizers.load_from_checkpoint(str(path))
        trainer = make_trainer(max_epochs=2)
        trainer.fit(TwoOptimizers(HPARAMS[kind]), ckpt_path=str(path))
    assert trainer.global_step == 2 * 2 * 2  # two epochs of two batches, two optimizers
    assert loaded.hparams == TwoOptimizers(HPARAMS[kind]).hparams
    assert len(checkpoint["optimizer_states"]) == 2 and len(checkpoint["lr_schedulers"]) == 2


def test_dict_subclass_in_hyperparameters_is_refused_with_the_reason(tmp_path):
    """torch's safe unpickler builds no dict subclass with items, allow-listed or not: an ``AttributeDict`` nested
    in the hyperparameters needs ``weights_only=False``."""
    trainer = _trainer(tmp_path)
    trainer.fit(HParamsModel(inner=AttributeDict(depth=2)))
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    with pytest.raises(pickle.UnpicklingError, match="Can only SETITEM for dict"):
        HParamsModel.load_from_checkpoint(str(path))
    assert HParamsModel.load_from_checkpoint(str(path), weights_only=False).hparams.inner.depth == 2


def test_omegaconf_hyperparameters_load_by_default(tmp_path):
    omegaconf = pytest.importorskip("omegaconf")
    config = omegaconf.OmegaConf.create({"lr": 0.1, "model": {"depth": 2, "names": ["a", 1, None, True]}})
    trainer = _trainer(tmp_path)
    trainer.fit(HParamsModel(config))
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    loaded = HParamsModel.load_from_checkpoint(str(path))
    assert isinstance(loaded.hparams, omegaconf.DictConfig) and loaded.hparams == config


def test_checkpoint_of_pure_1_6_5_loads_by_default(tmp_path):
    """A checkpoint written by upstream 1.6.5 (the compat-only build) with Namespace hyperparameters."""
    from fork_tools.materialize import materialize

    build = tmp_path / "compat"
    materialize(root=build, groups=("compat",))
    script = (
        "import argparse, sys; from tests.helpers import BoringModel; import pytorch_lightning as pl\n"
        "assert pl.__file__.startswith(sys.argv[2]), pl.__file__\n"
        "class M(BoringModel):\n"
        "    def __init__(self, hparams):\n        super().__init__(); self.save_hyperparameters(hparams)\n"
        "t = pl.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=0, logger=False,"
        " enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)\n"
        "t.fit(M(argparse.Namespace(lr=0.1, inner=argparse.Namespace(depth=2)))); t.save_checkpoint(sys.argv[1])\n"
    )
    path = tmp_path / "upstream.ckpt"
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": f"{build}:{root}", "PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", script, str(path), str(build)], check=True, env=env, timeout=300)
    assert "argparse.Namespace" in torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    model = HParamsModel.load_from_checkpoint(str(path))
    assert model.hparams.lr == 0.1
    trainer = _trainer(tmp_path, max_epochs=2)
    trainer.fit(BoringModel(), ckpt_path=str(path))
    assert trainer.global_step == 4


def test_old_torch_keeps_full_unpickling_with_a_warning(malicious, monkeypatch):
    bad, marker = malicious
    monkeypatch.setattr(safe_load, "_SAFE_GLOBALS_AVAILABLE", False)
    monkeypatch.setattr(safe_load, "_warned", set())
    with pytest.warns(UserWarning, match="cannot load checkpoints with `weights_only=True` and an allow-list"):
        pl_load(str(bad))
    assert marker.exists()


@pytest.mark.timeout(300)
def test_malicious_checkpoint_on_two_ranks(tmp_path):
    """Resuming FSDP on 2 CPU ranks from the malicious file: no rank runs the payload, every rank raises within
    60 s, naming the global, and so do ``cloud_io.load`` and ``TorchCheckpointIO``; the good file still resumes in
    the same processes."""
    ranks = run_scenario("tests.checkpointing.safe_load_scenarios", "refuse_then_resume", tmp_path, timeout=240)
    assert not (tmp_path / "PAYLOAD_RAN").exists(), "a rank ran the payload"
    for rank in ranks:
        assert rank["raised"] and rank["raised"].startswith("CheckpointError"), rank
        assert rank["unpickling"] and "posix.system" in rank["message"] and rank["seconds"] < 60, rank
        assert rank["other_paths"] == ["CheckpointError[UnpicklingError]"] * 2, rank
        assert rank["resumed_global_step"] == 4


def test_fault_tolerant_training_keeps_full_unpickling(monkeypatch):
    """Fault-tolerant training's own checkpoints hold reduction functions and numpy random states (see
    ``tests/utilities/test_auto_restart_torch2.py``, which resumes one): they load fully unless the call says
    ``weights_only=True``."""
    assert safe_load.resolve_weights_only(None) is True
    monkeypatch.setenv("PL_FAULT_TOLERANT_TRAINING", "1")
    assert safe_load.resolve_weights_only(None) is False
    assert safe_load.resolve_weights_only(True) is True


def test_a_load_keeps_what_the_user_allowed(malicious):
    """``torch.serialization.safe_globals`` removes its types from torch's process-wide allow-list on exit: a
    Lightning load must not take away a type the user allowed before."""
    bad, _ = malicious
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([argparse.Namespace, AttributeDict])
    try:
        pl_load(str(bad.with_name("good.ckpt")))
        allowed = torch.serialization.get_safe_globals()
        assert argparse.Namespace in allowed and AttributeDict in allowed
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def test_only_the_own_file_is_loaded_fully(malicious):
    """``loading_own_file`` lets a load of that one file unpickle it fully, whatever the ``Trainer`` call chose; any
    other file in the same block is loaded safely."""
    bad, marker = malicious
    other = bad.with_name("other.ckpt")
    other.write_bytes(bad.read_bytes())
    with safe_load.loading_own_file(str(bad.parent / "." / bad.name)), safe_load.trainer_weights_only(True):
        with pytest.raises(CheckpointError):
            pl_load(str(other))
        assert not marker.exists()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*unpickles them fully")
            pl_load(str(bad))
    assert marker.exists()
    with safe_load.trainer_weights_only(True):
        assert safe_load.resolve_weights_only(None) is True


class TunableModel(HParamsModel):
    """A model both tuners can tune; ``plant``: arguments of ``make_malicious_checkpoint``, called when the tuner's
    trial run ends, i.e. before the tuner restores the model's initial state."""

    def __init__(self, plant=None, **hparams):
        super().__init__(**hparams)
        self.plant, self.lr, self.batch_size = plant, 0.1, 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=self.lr)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(RandomDataset(32, 64), batch_size=self.batch_size)

    def on_train_end(self):
        if self.plant:
            make_malicious_checkpoint(*self.plant)


TUNERS = {
    "auto_lr_find": dict(lr_find_kwargs={"num_training": 3}),
    "auto_scale_batch_size": dict(scale_batch_size_kwargs={"max_trials": 1, "steps_per_trial": 1}),
}


@pytest.mark.parametrize("tuner", TUNERS)
def test_tuner_restores_its_own_file_fully(tmp_path, monkeypatch, tuner):
    """The initial state the tuner wrote holds what only a full unpickling builds (an ``AttributeDict`` nested in the
    hyperparameters): restored without the warning for unsafe loads."""
    monkeypatch.setattr(safe_load, "_warned", set())
    trainer = _trainer(tmp_path, **{tuner: True})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*unpickles them fully")
        trainer.tune(TunableModel(inner=AttributeDict(depth=2)), **TUNERS[tuner])
    assert not list(tmp_path.glob(".*.ckpt")), "the tuner's file was not removed"


@pytest.mark.parametrize("tuner", TUNERS)
def test_tuner_loads_a_planted_hpc_checkpoint_safely(tmp_path, malicious, tuner):
    """``CheckpointConnector.restore`` prefers an ``hpc_ckpt_<N>.ckpt`` in the root directory to the tuner's own
    file: one that appears while the tuner runs is loaded safely, so its payload is refused."""
    bad, marker = malicious
    root = tmp_path / "root"
    plant = (bad.with_name("good.ckpt"), root / "hpc_ckpt_1.ckpt", marker)
    trainer = _trainer(root, **{tuner: True})
    with pytest.raises(CheckpointError, match="hpc_ckpt_1.ckpt") as info:
        trainer.tune(TunableModel(plant=plant), **TUNERS[tuner])
    assert (root / "hpc_ckpt_1.ckpt").exists() and not marker.exists(), "the payload ran"
    _assert_refused(info.value, root / "hpc_ckpt_1.ckpt")


UPGRADE_CLI = "pytorch_lightning.utilities.upgrade_checkpoint"


def _upgrade(path: Path) -> subprocess.CompletedProcess:
    """``python -m pytorch_lightning.utilities.upgrade_checkpoint --file path``, with this repository's build."""
    command = [sys.executable, "-m", UPGRADE_CLI, "--file", str(path)]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _upgrade_in_this_process(path: Path, monkeypatch) -> None:
    """The same command line, its ``__main__`` code run in this process as ``python -m`` runs it (``runpy``)."""
    monkeypatch.setattr(sys, "argv", ["-m", "--file", str(path)])
    runpy.run_module(UPGRADE_CLI, run_name="__main__", alter_sys=True)


# `python -m` warns so too: the package's import imports the module (for its KEYS_MAPPING) before it runs as __main__
@pytest.mark.filterwarnings("ignore:'pytorch_lightning.utilities.upgrade_checkpoint' found in sys.modules")
def test_upgrade_checkpoint_cli_loads_safely(tmp_path, monkeypatch):
    """The upgrade tool loads like every other load: a checkpoint of the old schema with ``Namespace`` and enum
    hyperparameters is upgraded; a malicious file is refused and left as it was, unless
    ``PL_UNSAFE_CHECKPOINT_LOAD=1``. The first run is the real command line; the others run its code in this
    process, to spare the suite two interpreter starts."""
    legacy = {
        "epoch": 3,
        "global_step": 30,
        "state_dict": {"layer.weight": torch.ones(2, 2)},
        "hyper_parameters": {"args": argparse.Namespace(lr=0.1, inner=argparse.Namespace(depth=2))},
        "precision": PrecisionType.HALF,
        "checkpoint_callback_best_model_score": torch.tensor(0.5),
        "early_stop_callback_wait": 2,
    }
    path = tmp_path / "legacy.ckpt"
    torch.save(legacy, path)
    bad, marker = tmp_path / "bad.ckpt", tmp_path / "PAYLOAD_RAN"
    make_malicious_checkpoint(path, bad, marker)
    bad_bytes = bad.read_bytes()

    done = _upgrade(path)
    assert done.returncode == 0, done.stderr
    upgraded = torch.load(path, weights_only=False)
    assert upgraded["hyper_parameters"]["args"].inner.depth == 2 and upgraded["precision"] is PrecisionType.HALF
    assert upgraded["callbacks"][ModelCheckpoint]["best_model_score"] == 0.5
    assert upgraded["callbacks"][EarlyStopping]["wait_count"] == 2 and "early_stop_callback_wait" not in upgraded

    with pytest.raises(CheckpointError, match="posix.system"):
        _upgrade_in_this_process(bad, monkeypatch)
    assert not marker.exists() and bad.read_bytes() == bad_bytes

    monkeypatch.setenv("PL_UNSAFE_CHECKPOINT_LOAD", "1")
    _upgrade_in_this_process(bad, monkeypatch)
    assert marker.exists()


def test_old_torch_keeps_an_explicit_weights_only_true(malicious, monkeypatch):
    bad, marker = malicious
    monkeypatch.setattr(safe_load, "_SAFE_GLOBALS_AVAILABLE", False)
    with pytest.raises(pickle.UnpicklingError):
        pl_load(str(bad), weights_only=True)
    assert not marker.exists()
