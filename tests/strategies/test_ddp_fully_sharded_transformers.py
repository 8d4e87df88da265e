"""Real model code under ``DDPFullyShardedStrategy``: tiny random ``transformers`` models (GPT-2 with tied
embeddings, ResNet with BatchNorm), wrapped per block and as a whole, saved streamed and gathered, on 2 CPU ranks
(scenarios in ``fsdp_transformers_scenarios.py``; real FairScale FSDP over gloo, see ``fsdp_harness/cpu_fsdp.py``).

For each case the checkpoint loads strictly into the plain model and equals the gathered weights, and a fresh
Trainer resumes from it exactly on every rank: parameters, optimizer shards and buffers, except BatchNorm's running
statistics, which are per rank (the file holds global rank 0's; ``SyncBatchNorm``, on GPUs, keeps them in step).
GPT-2 with only its body wrapped shows a tie that FSDP splits between an instance and the head outside it.
"""
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from fsdp_harness.runner import Records, ScenarioBatch, run_scenario
from tests.helpers.runif import RunIf
from tests.strategies.test_ddp_fully_sharded_resume import assert_same

SCENARIOS = "tests.strategies.fsdp_transformers_scenarios"
DEVICES = 2


ENV = {"HF_HUB_OFFLINE": "1"}
# both models' ``cases`` run in one launch (``transformers_runs``)
BATCH_TIMEOUT = 840


def load_cases(out: Path, records: Records) -> Dict[str, List[Dict[str, Any]]]:
    """Each case's records, one per rank, of a ``cases`` run into ``out`` that returned ``records``."""
    return {
        case: [
            torch.load(out / f"{case}.rank{rank}.pt", map_location="cpu", weights_only=False) for rank in range(DEVICES)
        ]
        for case in records[0]["cases"]
    }


def run_cases(out: Path, model: str, *args: str, timeout: float = 540) -> Dict[str, List[Dict[str, Any]]]:
    """Run every case of ``model`` in one pair of processes; return each case's records, one per rank."""
    records = run_scenario(SCENARIOS, "cases", out, "--model", model, *args, devices=DEVICES, timeout=timeout, env=ENV)
    return load_cases(out, records)


def is_batchnorm_statistic(key: str) -> bool:
    return key.endswith(("running_mean", "running_var"))


def check_cases(
    cases: Dict[str, List[Dict[str, Any]]],
    model: str,
    wrappings: List[str],
    synced_statistics: bool = False,
    atol: float = 0.0,
) -> None:
    """The checks of the module docstring, for every case of ``model`` (records from :func:`load_cases`).

    BatchNorm statistics are per rank: the checkpoint holds global rank 0's, so a resumed rank 1 continues from rank
    0's statistics, unless ``SyncBatchNorm`` keeps them equal (``synced_statistics``)."""
    assert sorted(cases) == sorted(f"{w}-{s}" for w in wrappings for s in ("streamed", "gathered"))
    for case, records in cases.items():
        wrapping, streamed = case.split("-")[0], case.endswith("streamed")
        for rank, record in enumerate(records):
            assert record["global_steps"] == [4, 4], case
            assert (record["stream_reason"] is None) == streamed, (case, record["stream_reason"])
            straight, resumed = record["straight"], record["resumed"]
            exact = [k for k in straight["params"] if rank == 0 or synced_statistics or not is_batchnorm_statistic(k)]
            assert_same(
                {k: resumed["params"][k] for k in exact}, {k: straight["params"][k] for k in exact},
                f"{case} rank {rank} params", atol,
            )
            assert_same(resumed["optim"], straight["optim"], f"{case} rank {rank} optimizer shard", atol)
        file = records[0]["file"]
        gathered = records[0]["straight"]["params"]
        # every entry of the plain model's state dict is in the file, each name of a tied parameter included, with
        # the values the ranks gathered; the file loads strictly into the plain model
        assert sorted(file["saved"]) == sorted(file["plain"]), case
        assert_same(file["saved"], {k: gathered[k] for k in file["saved"]}, f"{case} file", atol)
        split = model == "gpt2" and wrapping == "body"
        # a tie that FSDP split (see ``split_warnings``) loads into the plain model with the value saved last
        last_saved = {"model.transformer.wte.weight": "model.lm_head.weight"} if split else {}
        loaded = {k: file["saved"][last_saved.get(k, k)] for k in file["plain"]}
        assert_same(file["plain"], loaded, f"{case} plain model", atol)
        expected_warnings = 1 if split else 0
        assert [len(r["split_warnings"]) for r in records] == [2 * expected_warnings, 0], case
        statistics = [k for k in file["plain"] if is_batchnorm_statistic(k)]
        if model == "resnet":
            assert statistics and any(file["plain"][k].dtype == torch.int64 for k in file["plain"])
            other = records[1]["straight"]["params"]
            differ = [k for k in statistics if not torch.allclose(other[k], gathered[k], rtol=0, atol=atol)]
            # without SyncBatchNorm each rank's statistics follow its own batches, and the file has rank 0's
            assert bool(differ) != synced_statistics, differ
        else:
            assert {"model.lm_head.weight", "model.transformer.wte.weight"} <= set(file["saved"])
            tied = torch.equal(gathered["model.lm_head.weight"], gathered["model.transformer.wte.weight"])
            assert tied != split, case


# the wrappings each model is tested with: per block (inside an instance for the rest) and as a whole; GPT-2 also
# with its body alone, which splits the tie between an FSDP instance and the head outside it
WRAPPINGS = {"gpt2": ["block", "whole", "body"], "resnet": ["block", "whole"]}


@pytest.fixture(scope="module")
def transformers_runs(tmp_path_factory) -> ScenarioBatch:
    batch = ScenarioBatch(SCENARIOS, tmp_path_factory.mktemp("transformers"), DEVICES, timeout=BATCH_TIMEOUT, env=ENV)
    for model, wrappings in sorted(WRAPPINGS.items()):
        batch.add(model, "cases", "--model", model, "--wrappings", *wrappings)
    return batch


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
@pytest.mark.parametrize("model", sorted(WRAPPINGS))
def test_transformers_models_save_and_resume_exactly(transformers_runs, model):
    """The fork before this test could not resume GPT-2 with its tied embeddings inside one FSDP instance: the
    tied ``lm_head.weight`` was an unexpected key. A tie that FSDP splits is saved under both names, resumes
    exactly and loads strictly; global rank 0 warns that it was split."""
    cases = load_cases(transformers_runs.folder(model), transformers_runs.results(model))
    check_cases(cases, model, WRAPPINGS[model])


@RunIf(min_gpus=2, skip_windows=True, standalone=True, fairscale_fully_sharded=True)
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("model", "sync_batchnorm"), [("gpt2", False), ("resnet", False), ("resnet", True)])
def test_transformers_models_save_and_resume_exactly_multi_gpu(tmp_path, model, sync_batchnorm):
    # the body of test_transformers_models_save_and_resume_exactly on GPUs; with SyncBatchNorm, which needs them,
    # the statistics are the same on every rank, and so is the resumed run's
    extra = ["--sync-batchnorm"] if sync_batchnorm else []
    cases = run_cases(tmp_path, model, "--wrappings", *WRAPPINGS[model], "--accelerator", "gpu", *extra)
    check_cases(cases, model, WRAPPINGS[model], synced_statistics=sync_batchnorm, atol=1e-5)


def _shard_limit_for(shards: int, path: Path, dtype: str) -> int:
    """A ``--max-shard-size`` (bytes) that cuts the published weights of the checkpoint at ``path``, in ``dtype``,
    into ``shards`` files, as huggingface_hub cuts them."""
    from huggingface_hub import split_torch_state_dict_into_shards

    state_dict = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    weights = {k[len("model.") :]: v.to(getattr(torch, dtype)) for k, v in state_dict.items()}
    total = sum(v.nbytes for v in weights.values())
    for limit in range(total // shards, total, 1024):
        if len(split_torch_state_dict_into_shards(weights, max_shard_size=limit).filename_to_tensors) == shards:
            return limit
    raise AssertionError(f"no limit gives {shards} shards")


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
def test_a_gpt2_trained_under_fsdp_is_published_for_transformers(transformers_runs, tmp_path):
    """The streamed checkpoint of GPT-2 (tied embeddings, a block per FSDP unit, 2 ranks), converted with
    ``--to safetensors --strip-prefix model.`` into 3 shards, loads in ``transformers`` with no missing, unexpected
    or mismatched key and gives the fork model's logits; ``--dtype bfloat16`` gives bf16 shards."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from pytorch_lightning.utilities.convert_checkpoint import convert_checkpoint
    from tests.strategies.fsdp_transformers_scenarios import build_model

    folder = transformers_runs.folder("gpt2")
    records = load_cases(folder, transformers_runs.results("gpt2"))["block-streamed"]
    assert records[0]["stream_reason"] is None
    path = folder / "block-streamed" / "straight" / "ckpts" / "epoch=1.ckpt"
    fork_model = build_model("gpt2").eval()
    # the fork model at the end of training: its gathered parameters, every name of the tie
    fork_model.load_state_dict({k[len("model.") :]: v for k, v in records[0]["straight"]["params"].items()})
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for dtype in ("float32", "bfloat16"):
        dst, limit = tmp_path / dtype, _shard_limit_for(3, path, dtype)
        # the command line's function, in this process (its command line is tested in test_convert_checkpoint.py)
        convert_checkpoint(
            path, dst, to="safetensors", strip_prefix="model.", max_shard_size=str(limit), dtype=dtype, progress=False
        )
        shards = sorted(p.name for p in dst.glob("*.safetensors"))
        assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
        for shard in shards:
            with safe_open(str(dst / shard), "pt") as f:
                assert f.metadata() == {"format": "pt"}
                assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"F32" if dtype == "float32" else "BF16"}
        build_model("gpt2").config.save_pretrained(dst)
        published, info = AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)
        assert all(not info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        with torch.no_grad():
            logits, expected = published.eval()(tokens).logits, fork_model(tokens).logits
        if dtype == "float32":
            assert torch.equal(logits, expected)
        else:
            assert logits.dtype == torch.bfloat16 and torch.allclose(logits.float(), expected, atol=0.1)
