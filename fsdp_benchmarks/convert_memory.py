"""Converter memory benchmark: ``python -m fsdp_benchmarks.convert_memory [--size-mb 256] [--units 16] [--optimizer
adam] [--json OUT]``.

Writes a checkpoint file in the fork's portable FSDP layout: a ``state_dict`` of ``--units`` blocks of ``width x width``
linear layers (``--size-mb`` of fp32 weights in all), and the optimizer state as FSDP saves it, one record per unit
and state key with a view per parameter, plus ``param_names``. The file is synthetic (no FSDP run), so it is the same
whatever the strategy's save writes; the converter reads only this layout. Then, in a fresh process per method (with
``MALLOC_MMAP_THRESHOLD_=65536``, as ``checkpoint_memory`` runs its ranks), it converts the file (into a DCP
directory, or the model weights into safetensors shards) and measures the extra memory of the conversion with
``fsdp_harness.memory_sampler.PeakMemory``:

- ``converter``: ``convert_checkpoint(SRC, DST, to="dcp")``, what
  ``python -m pytorch_lightning.utilities.convert_checkpoint`` runs;
- ``by-hand``: what a user writes with torch alone, as DeepSpeed's ``zero_to_fp32.py`` and DCP's
  ``dcp_to_torch_save`` hold a whole model: ``torch.load`` of the whole file, then ``dcp.save`` of the same
  ``{"model", "optim"}`` with ``no_dist=True``;
- ``converter-safetensors``: ``convert_checkpoint(SRC, DST, to="safetensors", dtype="bfloat16")``, the model weights
  published in bf16 (each tensor converted), in shards of ``--shard-mb``;
- ``by-hand-safetensors``: what a user writes with ``huggingface_hub``: ``torch.load(mmap=True)``, each weight
  converted to bf16, then ``huggingface_hub.save_torch_state_dict`` with the same shard size;
- ``converter-from-dcp``: ``import_dcp(DCP, DST)``, what ``--from dcp`` runs, from the DCP directory the converter
  wrote of the file (``source.dcp``, written once, by the first such method before it measures). Its placeholders
  are fake tensors, as the fork's streamed FSDP save makes them: the first fake tensor of a process costs a fixed
  amount of memory (torch's lazily built dispatch state, whatever the size), measured apart (``init_mb``) before
  the conversion is;
- ``by-hand-from-dcp``: torch's ``dcp_to_torch_save(DCP, DST)``, which loads the whole state before it saves it (its
  file holds DCP's keys, not a checkpoint 1.6.5 resumes: the peer in memory only).

Reported per method: peak extra anonymous memory (what cannot be reclaimed), mapped file pages (the memory-mapped
source: page cache, reclaimable), wall time, against the file size and the largest tensor, and the fixed cost measured
before the conversion (``init_mb``: the first fake tensor, ``converter-from-dcp`` only). Exits non-zero when the
converter's peak extra anonymous memory exceeds twice the largest tensor plus 16 MiB.
"""
import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # started as a file: see checkpoint_memory.py

from fsdp_harness.memory_sampler import MIB  # noqa: E402
from fsdp_harness.multiprocess import run_module  # noqa: E402

MODULE = "fsdp_benchmarks.convert_memory"
METHODS = [
    "converter", "by-hand", "converter-safetensors", "by-hand-safetensors", "converter-from-dcp", "by-hand-from-dcp"
]
SLACK_MB = 16
OPTIMIZER_KEYS = {"adam": ["exp_avg", "exp_avg_sq"], "sgd": ["momentum_buffer"]}


def write_checkpoint(path: Path, size_mb: float, units: int, optimizer: str) -> Dict[str, Any]:
    """The synthetic checkpoint (see the module's docstring); returns its file and largest tensor sizes."""
    import torch

    width = max(1, int(math.sqrt(size_mb * MIB / 4 / units)))
    generator = torch.Generator().manual_seed(0)
    state_dict: Dict[str, Any] = {}
    state: Dict[int, Dict[str, Any]] = {}
    for unit in range(units):
        shapes = {f"layer.{unit}.weight": (width, width), f"layer.{unit}.bias": (width,)}
        first = len(state_dict)
        for name, shape in shapes.items():
            state_dict[name] = torch.randn(shape, generator=generator)
            state[len(state_dict) - 1] = {"step": torch.tensor(3.0)} if optimizer == "adam" else {}
        for key in OPTIMIZER_KEYS[optimizer]:
            record = torch.randn(sum(math.prod(s) for s in shapes.values()), generator=generator)
            offset = 0
            for index, shape in enumerate(shapes.values(), start=first):
                state[index][key] = record[offset : offset + math.prod(shape)].view(shape)
                offset += math.prod(shape)
    group = {"lr": 1e-3, "params": list(range(len(state_dict)))}
    optimizer_state = {"state": state, "param_groups": [group], "param_names": list(state_dict)}
    torch.save({"state_dict": state_dict, "optimizer_states": [optimizer_state], "epoch": 0, "global_step": 3}, path)
    largest = max(t.nbytes for t in state_dict.values())
    return {"file_mb": path.stat().st_size / MIB, "largest_tensor_mb": largest / MIB, "width": width}


def dcp_source(src: Path) -> Path:
    """The DCP directory of the file, as the converter writes it: the source of the ``-from-dcp`` methods, written
    by the first of them, before it measures (in its own process: the runner does not import Lightning)."""
    import warnings

    from pytorch_lightning.utilities.convert_checkpoint import convert_checkpoint

    directory = src.with_suffix(".dcp")
    if not directory.exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            convert_checkpoint(src, directory, to="dcp", progress=False)
    return directory


def measure(method: str, src: Path, dst: Path, shard_mb: float) -> Dict[str, Any]:
    """One conversion in this process, measured."""
    from fsdp_harness.memory_sampler import PeakMemory

    shard_bytes = int(shard_mb * MIB)
    init_mb = 0.0
    if method == "converter":
        from pytorch_lightning.utilities.convert_checkpoint import convert_checkpoint

        with PeakMemory() as meter:
            convert_checkpoint(src, dst, to="dcp", progress=False)
    elif method == "converter-safetensors":
        from pytorch_lightning.utilities.convert_checkpoint import convert_checkpoint

        with PeakMemory() as meter:
            convert_checkpoint(
                src, dst, to="safetensors", dtype="bfloat16", max_shard_size=str(shard_bytes), progress=False
            )
    elif method == "converter-from-dcp":
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        from pytorch_lightning.utilities.convert_checkpoint import import_dcp

        source = dcp_source(src)
        with PeakMemory() as first_fake_tensor, FakeTensorMode():
            torch.empty(1)
        init_mb = first_fake_tensor.result()["peak_extra_mb"]
        with PeakMemory() as meter:
            import_dcp(source, dst, progress=False)
    elif method == "by-hand-from-dcp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        source = dcp_source(src)
        with PeakMemory() as meter:
            dcp_to_torch_save(source, dst)
    elif method == "by-hand-safetensors":
        import torch
        from huggingface_hub import save_torch_state_dict

        dst.mkdir(parents=True, exist_ok=True)
        with PeakMemory() as meter:
            state_dict = torch.load(src, mmap=True, weights_only=True)["state_dict"]
            weights = {key: value.to(torch.bfloat16) for key, value in state_dict.items()}
            save_torch_state_dict(weights, str(dst), max_shard_size=shard_bytes)
            del state_dict, weights
    else:
        import torch
        import torch.distributed.checkpoint as dcp

        from pytorch_lightning.utilities import named_optimizer_state

        with PeakMemory() as meter:
            checkpoint = torch.load(src, weights_only=True)
            optim = named_optimizer_state(checkpoint["optimizer_states"][0])
            state = {"model": checkpoint["state_dict"], "optim": optim}
            dcp.save(state, checkpoint_id=str(dst), no_dist=True)
            del checkpoint, state, optim
    return {"method": method, **meter.result(), "init_mb": init_mb}


def run(args: argparse.Namespace, folder: Path) -> List[Dict[str, Any]]:
    src = folder / "source.ckpt"
    info = write_checkpoint(src, args.size_mb, args.units, args.optimizer)
    methods = args.methods.split(",")
    # written anew, by the first -from-dcp method, from this run's file (an --out folder may hold an earlier one)
    shutil.rmtree(folder / "source.dcp", ignore_errors=True)
    results = []
    for method in methods:
        out = folder / f"{method}.json"
        argv = ["--measure", method, "--src", str(src), "--dst", str(folder / f"{method}.out"), "--result", str(out)]
        argv += ["--shard-mb", str(args.shard_mb)]
        launched = run_module(MODULE, argv, timeout=args.timeout, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
        if launched.returncode != 0 or not out.exists():
            raise SystemExit(f"{method} failed (exit code {launched.returncode}):\n{launched.output[-4000:]}")
        results.append({**json.loads(out.read_text()), **info})
        output = folder / f"{method}.out"
        shutil.rmtree(output, ignore_errors=True) if output.is_dir() else output.unlink(missing_ok=True)
    bound = 2 * info["largest_tensor_mb"] + SLACK_MB
    for result in results:
        result["bound_mb"] = bound
        result["ok"] = not result["method"].startswith("converter") or result["peak_extra_mb"] <= bound
    return results


def table(results: List[Dict[str, Any]]) -> str:
    first = results[0]
    lines = [
        f"file {first['file_mb']:.1f} MiB, largest tensor {first['largest_tensor_mb']:.1f} MiB; converter bound"
        f" {first['bound_mb']:.1f} MiB (2 x largest tensor + {SLACK_MB} MiB)",
        f"{'method':<21} {'extra anon MiB':>15} {'x file':>7} {'mapped file MiB':>16} {'seconds':>8} {'init MiB':>9}"
        "  ok",
    ]
    for r in results:
        lines.append(
            f"{r['method']:<21} {r['peak_extra_mb']:>15.1f} {r['peak_extra_mb'] / r['file_mb']:>7.2f}"
            f" {r['peak_extra_file_mb']:>16.1f} {r['seconds']:>8.2f} {r['init_mb']:>9.1f}  {'yes' if r['ok'] else 'NO'}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=256, help="fp32 weights in MiB (the file: about 3x, Adam)")
    parser.add_argument("--units", type=int, default=16, help="blocks, one optimizer record per block and state key")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_KEYS), default="adam")
    parser.add_argument("--shard-mb", type=float, default=64, help="the safetensors methods' largest shard, in MiB")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--out", type=Path, help="folder for the files (default: a temp dir, removed)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per measured conversion")
    parser.add_argument("--measure", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dst", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    unknown = sorted(set(args.methods.split(",")) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods: {', '.join(unknown)}")
    if args.measure:
        args.result.write_text(json.dumps(measure(args.measure, args.src, args.dst, args.shard_mb)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.out or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        results = run(args, folder)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if not all(r["ok"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
