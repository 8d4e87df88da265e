"""Checkpoint memory benchmark: ``python -m fsdp_benchmarks.checkpoint_memory [--devices 2,4] [--size-mb 256] ...``
(or ``python fsdp_benchmarks/checkpoint_memory.py ...``).

First it prepares the builds the chosen configurations run on (``fsdp_benchmarks/builds.py``: the pure 1.6.5
baseline is materialised once into ``<out>/builds/compat/``). Then, for each world size N and each configuration
(``fsdp_benchmarks/configs.py``), it starts N ranks of ``python -m fsdp_benchmarks.worker`` (Lightning's launcher starts
ranks >= 1) on that configuration's build, with ``MALLOC_MMAP_THRESHOLD_=65536`` in their environment and every rank
bounded by a timeout. Each rank measures the extra memory (peak minus baseline: anonymous, and anonymous plus mapped
file pages) and wall time of ``trainer.save_checkpoint`` and of resuming with ``fit(ckpt_path=...)`` in a fresh
Trainer; rank 0 checks the file against the gathered parameters. Prints a table (per-rank rows and node totals, MiB
and x S), and optionally writes JSON (``--json``) and a plot (``--plot``). Exits non-zero when any run fails its check.

Each rank also counts the bytes it writes into the checkpoint during the measured save (instrumented in the worker,
:mod:`fsdp_benchmarks.checkpoint_io_meter`). ``--write-mbps B`` throttles every rank's checkpoint writes to B MB/s,
an emulation of one link per rank to shared storage; a second table gives the save time against N. The torch DCP
peer (``dcp-fsdp2``) runs in the same invocation, its ranks started here rather than by Lightning. A configuration
whose strategy arguments this build does not take is skipped with a "not in this build" note.

The model is K blocks whose width follows from S (``--size-mb``), or is given (``--width``; S then follows); ``--heads
H`` adds an input and an output head of width H, each its own FSDP unit (``--units 8 --width 2048 --heads 1024`` is
the shape of issue 38: F, the file, about 288 MiB with SGD's momentum). ``--repeat R`` runs every configuration R
times at each N, in alternating order, and adds a table of the medians of the save time, of the time outside the
checkpoint's writes and syncs (:mod:`fsdp_benchmarks.checkpoint_io_meter` sums it), and of their ratio to the torch
DCP peer's with the same optimizer.

The remote configurations (``storage="s3"`` in :mod:`fsdp_benchmarks.configs`) run in the same invocation: when one
is selected, the runner starts one moto server (:mod:`fsdp_harness.s3_server`) and one bucket for the whole
invocation, and for each run a fresh proxy per rank (:mod:`fsdp_harness.s3_proxy`), so that each rank's counts of the
bytes it sent to and received from the server are that run's alone. The checkpoint is
``s3://<bucket>/run<R>/<config>-n<N>.ckpt`` (the DCP peer's a ``.dcp`` directory of objects). A further table gives,
per remote configuration and N, the slowest rank's save and resume times, the largest rank's extra memory in F (the
checkpoint's size), and per rank the bytes sent while saving and received while resuming in F/N.
"""
import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

if not __package__:
    # Started as a file: Python put this folder, not the repository root, first on sys.path, so neither this
    # package nor fsdp_harness would import (and this folder's modules would shadow top-level names).
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from fsdp_benchmarks import builds as lightning_builds  # noqa: E402
from fsdp_benchmarks import configs as registry  # noqa: E402
from fsdp_benchmarks import report  # noqa: E402
from fsdp_benchmarks.model import shape_mb as model_shape_mb  # noqa: E402
from fsdp_harness.multiprocess import free_port, ScriptResult, run_module, run_tasks  # noqa: E402

MMAP_THRESHOLD = "65536"


def parse_devices(text: str) -> List[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--devices expects positive integers such as 2 or 2,4, got {text!r}")
    return values


def parse_configs(text: str) -> List[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in names if n not in registry.names()]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown configuration(s) {unknown}; known: {', '.join(registry.names())}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_benchmarks.checkpoint_memory", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--devices", type=parse_devices, default=[2], help="world size, or a list such as 2,4")
    parser.add_argument("--size-mb", type=float, default=256, help="full fp32 state-dict size S in MiB")
    parser.add_argument("--units", type=int, default=16, help="number of FSDP-wrapped blocks K")
    parser.add_argument(
        "--width", type=int, default=0, help="the blocks' width w, in place of the one --size-mb gives (S then follows)"
    )
    parser.add_argument(
        "--heads", type=int, default=0,
        help="add an input head Linear(H, w) and an output head Linear(w, H), each its own FSDP unit (0: none)",
    )
    parser.add_argument(
        "--repeat", type=int, default=1,
        help="run every configuration this many times, in alternating order, and print the medians of the save time",
    )
    parser.add_argument("--optimizer", choices=["sgd", "sgd-plain", "adam"], default="sgd")
    parser.add_argument(
        "--configs", type=parse_configs, default=registry.names(), help=f"comma list of {', '.join(registry.names())}"
    )
    parser.add_argument("--accelerator", choices=["auto", "cpu", "gpu"], default="auto",
                        help="gpu: real CUDA/NCCL with DDPFullyShardedStrategy; auto picks gpu when >= N GPUs")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="write a PNG plot here")
    parser.add_argument(
        "--out", type=Path, help="folder for checkpoints and rank results (default: a temp dir, removed)"
    )
    parser.add_argument("--timeout", type=float, help="seconds per run, all ranks (default: scales with S and N)")
    parser.add_argument(
        "--fit-every", type=int, default=0,
        help="also time a fit of --fit-steps steps that saves every this many steps, per configuration and N, against"
        " the same fit without saves (0: skip)",
    )
    parser.add_argument("--fit-steps", type=int, default=16, help="training steps of the --fit-every fits")
    parser.add_argument(
        "--write-mbps", type=float,
        help="emulated per-writer bandwidth: throttle every rank's checkpoint writes to this many MB/s (10^6 bytes)",
    )
    parser.add_argument(
        "--keep-checkpoints", action="store_true",
        help="keep each run's checkpoint in --out (to compare the files two builds write; they are S-sized)",
    )
    return parser


def resolve_accelerator(choice: str, world_size: int) -> str:
    if choice != "auto":
        return choice
    import torch

    return "gpu" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "cpu"


class ObjectStorage:
    """The invocation's S3 server (moto's, :mod:`fsdp_harness.s3_server`, S3's 5 MiB minimum part) and bucket, started
    only when a remote configuration is selected; :meth:`ranks_env` starts a fresh proxy per rank for one run."""

    def __init__(self) -> None:
        from fsdp_harness.s3_server import make_bucket, rank_endpoints_env, start_s3_server

        # What the ranks' S3 clients must not see (another endpoint, a profile, other credentials) is removed from
        # this process's environment, which every rank inherits: the runner passes variables to set, not to remove.
        for name, value in rank_endpoints_env(["http://127.0.0.1:1"]).items():
            if value is None:
                os.environ.pop(name, None)
        self.server = start_s3_server()
        self.bucket = make_bucket(self.server.endpoint)

    def url(self, config: registry.BenchConfig, world_size: int, repeat: int) -> str:
        suffix = ".dcp" if config.scenario == "dcp_save_and_resume" else ".ckpt"
        return f"s3://{self.bucket}/run{repeat}/{config.name}-n{world_size}{suffix}"

    @contextmanager
    def ranks_env(self, world_size: int) -> Iterator[Dict[str, str]]:
        """The environment of one run's ranks: each rank's clients reach the server through a proxy of its own,
        started here and stopped after the run, so its counts hold that run's bytes only."""
        from fsdp_harness.s3_proxy import start_proxy
        from fsdp_harness.s3_server import rank_endpoints_env

        proxies = []
        try:
            for _ in range(world_size):
                proxies.append(start_proxy(self.server.endpoint, []))
            env = rank_endpoints_env([proxy.endpoint for proxy in proxies])
            yield {name: value for name, value in env.items() if value is not None}
        finally:
            for proxy in proxies:
                proxy.stop()

    def close(self) -> None:
        from fsdp_harness.s3_server import remove_bucket

        try:
            remove_bucket(self.server.endpoint, self.bucket)
        finally:
            self.server.stop()

    def describe(self) -> str:
        from importlib import metadata

        part = os.environ.get("PL_CHECKPOINT_PART_BYTES")
        return (
            f"moto {metadata.version('moto')} server on the loopback (minimum part {self.server.min_part_size} bytes),"
            " one fsdp_harness.s3_proxy per rank per run counting the bytes each rank sends to and receives from it;"
            f" the fork's part size {'PL_CHECKPOINT_PART_BYTES=' + part if part else 'by default'}"
        )


def run_one(
    config: str, world_size: int, args: argparse.Namespace, out: Path, build: lightning_builds.Build, repeat: int = 0,
    storage: Optional[ObjectStorage] = None,
) -> Dict[str, Any]:
    run_dir = out / (f"{config}-n{world_size}" + (f"-r{repeat}" if repeat else ""))
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    accelerator = resolve_accelerator(args.accelerator, world_size)
    bench = registry.by_name(config)
    worker_args = [
        "save_and_resume", "--config", config, "--out", str(run_dir), "--devices", str(world_size),
        "--size-mb", str(args.size_mb), *_shape_arguments(args),
        "--optimizer", bench.optimizer or args.optimizer, "--accelerator", accelerator,
    ]
    if args.write_mbps:
        worker_args += ["--write-mbps", str(args.write_mbps)]
    env = {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD, **bench.env}
    timeout = args.timeout or 180 + 1.0 * args.size_mb * world_size
    if args.write_mbps:
        # at the cap, rank 0 writes the checkpoint (up to 3 x S with Adam) twice when a streamed save is checked
        # against a gathered one (1 MiB is 1.05 MB)
        timeout += 2 * 3 * args.size_mb * 1.05 / args.write_mbps
    if bench.remote:
        assert storage is not None, "a remote configuration runs with the invocation's ObjectStorage"
        worker_args += ["--ckpt-url", storage.url(bench, world_size, repeat)]
        if not args.timeout:
            # the object goes through a proxy and moto, both Python, and rank 0 downloads it for the checks
            timeout += 2.0 * args.size_mb * world_size
        with storage.ranks_env(world_size) as s3_env:
            result = start_ranks(bench, worker_args, world_size, timeout, {**env, **s3_env}, build)
    else:
        result = start_ranks(bench, worker_args, world_size, timeout, env, build)
    (run_dir / "output.log").write_text(result.output)
    ranks, missing = [], []
    for rank in range(world_size):
        path = run_dir / f"rank{rank}.json"
        if path.exists():
            ranks.append(json.loads(path.read_text()))
        else:
            missing.append(rank)
    if result.timed_out or result.returncode != 0 or missing:
        why = "timed out" if result.timed_out else f"exit code {result.returncode}"
        errors = [p.read_text() for p in sorted(run_dir.glob("rank*.error"))]
        lines = (errors[0] if errors else result.output).strip().splitlines()
        detail = lines[-1] if lines else "no output"
        print(f"  {config} N={world_size}: FAILED ({why}, ranks without result {missing}): {detail}", flush=True)
        print(result.output[-4000:], file=sys.stderr)
        return report.failed_run(config, world_size, args.size_mb, f"{why}; missing ranks {missing}; {detail}")
    wrong_build = [r["rank"] for r in ranks if not build.imported_by(r["lightning_file"])]
    if wrong_build:
        detail = (
            f"ranks {wrong_build} imported {ranks[0]['lightning_file']}, not the {build.name} build {build.package}"
        )
        print(f"  {config} N={world_size}: FAILED: {detail}", flush=True)
        return report.failed_run(config, world_size, args.size_mb, detail)
    run = report.make_run(config, world_size, ranks, complete=bench.complete)
    run["storage"] = bench.storage
    run["wall_seconds"] = result.seconds
    run["write_mbps"] = args.write_mbps
    for path in [] if args.keep_checkpoints else run_dir.glob("*.ckpt"):
        path.unlink()  # keep --out small: the checkpoints are S-sized and only needed inside the run
    return run


def _shape_arguments(args: argparse.Namespace) -> List[str]:
    return ["--units", str(args.units), "--width", str(args.width), "--heads", str(args.heads)]


def start_ranks(
    config: registry.BenchConfig, worker_args: List[str], world_size: int, timeout: float, env: Dict[str, str],
    build: lightning_builds.Build,
) -> ScriptResult:
    """Lightning configurations: rank 0 only, whose launcher starts the others; the DCP peer: every rank, as
    ``torchrun`` would, with the usual ``RANK``/``WORLD_SIZE``/``MASTER_*`` variables."""
    if config.lightning:
        return run_module("fsdp_benchmarks.worker", worker_args, timeout=timeout, env=env, path_first=build.path_first)
    shared = {**os.environ, **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
              "WORLD_SIZE": str(world_size)}
    envs = [{**shared, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(world_size)]
    return run_tasks("fsdp_benchmarks.worker", [config.scenario, *worker_args[1:]], envs, timeout=timeout)


def fit_one(
    config: str, world_size: int, every: int, args: argparse.Namespace, out: Path, build: lightning_builds.Build
) -> Dict[str, Any]:
    """One ``fit_with_checkpoints`` run (see :mod:`fsdp_benchmarks.worker`): rank 0's result, or a failed one."""
    run_dir = out / f"fit-{config}-n{world_size}-every{every}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    worker_args = [
        "fit_with_checkpoints", "--config", config, "--out", str(run_dir), "--devices", str(world_size),
        "--size-mb", str(args.size_mb), *_shape_arguments(args),
        "--optimizer", registry.by_name(config).optimizer or args.optimizer,
        "--accelerator", resolve_accelerator(args.accelerator, world_size), "--steps", str(args.fit_steps),
        "--every", str(every),
    ]
    env = {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD, **registry.by_name(config).env}
    timeout = args.timeout or 300 + 2.0 * args.size_mb * world_size
    result = run_module("fsdp_benchmarks.worker", worker_args, timeout=timeout, env=env, path_first=build.path_first)
    (run_dir / "output.log").write_text(result.output)
    path = run_dir / "rank0.json"
    for ckpt in run_dir.glob("*.ckpt"):
        ckpt.unlink()
    if result.returncode != 0 or not path.exists():
        print(f"  fit {config} N={world_size} every={every}: FAILED\n{result.output[-3000:]}", file=sys.stderr)
        return {"config": config, "world_size": world_size, "every": every, "ok": False}
    return {**json.loads(path.read_text()), "ok": True}


def main(argv: List[str] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.width < 0 or args.heads < 0:
        parser.error("--repeat must be at least 1, --width and --heads at least 0")
    if args.heads and not args.width:
        parser.error("--heads needs --width: S then follows from the shape")
    if args.width:
        # S follows from the shape; the ranks still take --size-mb for the model's seed
        args.size_mb = round(model_shape_mb(args.units, args.width, args.heads), 3)
    temp = None
    if args.out is None:
        temp = tempfile.mkdtemp(prefix="checkpoint_memory-")
        out = Path(temp)
    else:
        out = args.out
        out.mkdir(parents=True, exist_ok=True)
    runs: List[Dict[str, Any]] = []
    fits: List[Dict[str, Any]] = []
    skipped = _skipped(args.configs)
    configs = [c for c in args.configs if c not in skipped]
    total = len(args.devices) * len(configs) * args.repeat
    start = time.monotonic()
    storage: Optional[ObjectStorage] = None
    storage_description = None
    try:
        builds = lightning_builds.prepare((registry.by_name(c).build for c in configs), out)
        if any(registry.by_name(c).remote for c in configs):
            storage = ObjectStorage()
            storage_description = storage.describe()
            print(f"object storage: {storage_description}", flush=True)
        for world_size in args.devices:
            # every repeat runs the configurations in the other order, so none is always first after a quiet spell
            for repeat in range(args.repeat):
                for config in configs if repeat % 2 == 0 else configs[::-1]:
                    print(f"[{len(runs) + 1}/{total}] {config}, N={world_size}, S={args.size_mb:g} MiB,"
                          f" K={args.units}, {registry.by_name(config).optimizer or args.optimizer}: running...",
                          flush=True)
                    run = run_one(
                        config, world_size, args, out, builds[registry.by_name(config).build], repeat, storage
                    )
                    run["repeat"] = repeat
                    runs.append(run)
                    if run["ranks"]:
                        print(f"[{len(runs)}/{total}] {config}, N={world_size}: node save"
                              f" +{run['node_save_peak_extra_anon_file_mb']:.1f} MiB anon+file"
                              f" ({run['node_save_x_s']:.2f} x S), resume +{run['node_load_peak_extra_mb']:.1f} MiB"
                              f" ({run['node_load_x_s']:.2f} x S), save {report.slowest_save_seconds(run):.3f} s,"
                              f" ok={run['ok']}, {run['wall_seconds']:.0f} s", flush=True)
        if args.fit_every:
            for world_size in args.devices:
                # the DCP peer has no fit, and the remote configurations' fits would need a proxy per rank
                lightning = [c for c in configs if registry.by_name(c).lightning and not registry.by_name(c).remote]
                plan = [(lightning[0], 0)] + [(c, args.fit_every) for c in lightning] if lightning else []
                for config, every in plan:
                    print(
                        f"fit of {args.fit_steps} steps, {config}, N={world_size}, saving every {every}...", flush=True
                    )
                    fits.append(fit_one(config, world_size, every, args, out, builds[registry.by_name(config).build]))
    finally:
        if storage is not None:
            storage.close()
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    # the first of the repeats in the tables and plot of one run per configuration and N; all in the medians
    first = [run for run in runs if run["repeat"] == 0]
    print()
    print(report.table(first))
    print()
    print(report.stall_table(first))
    print()
    print(report.save_time_table(first, args.write_mbps))
    if args.repeat > 1:
        print()
        print(report.median_save_table(runs))
    if report.crc_cost_table(runs):
        print()
        print(report.crc_cost_table(runs))
    if report.remote_table(first):
        print()
        print(report.remote_table(first))
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    if fits:
        print()
        print(report.fit_table([f for f in fits if f["ok"]]))
    meta = {
        "command": " ".join(["python -m fsdp_benchmarks.checkpoint_memory", *(sys.argv[1:] if argv is None else argv)]),
        "size_mb": args.size_mb,
        "units": args.units,
        "width": args.width,
        "heads": args.heads,
        "repeat": args.repeat,
        "optimizer": args.optimizer,
        "devices": args.devices,
        "configs": configs,
        "skipped": skipped,
        "write_mbps": args.write_mbps,
        "write_bandwidth": (
            f"emulated: every rank's checkpoint writes throttled to {args.write_mbps:g} MB/s in the worker"
            if args.write_mbps else "not throttled"
        ),
        "configurations": {c.name: c.description for c in registry.CONFIGS if c.name in configs},
        "builds": {b.name: b.version for b in builds.values()},
        "machine": f"{platform.machine()}, {_cpu_model()}, {_cpus()} CPUs, {_memory_gb():.0f} GB RAM",
        "python": platform.python_version(),
        "versions": _versions(),
        "malloc_mmap_threshold": MMAP_THRESHOLD,
        "object_storage": storage_description,
        "memory": (
            "save: anonymous + mapped file pages; resume: anonymous, mapped file pages beside it (node: largest rank)"
        ),
        "seconds": time.monotonic() - start,
        "fits": fits,
    }
    if args.json:
        report.write_json(runs, args.json, meta)
        print(f"wrote {args.json}")
    if args.plot:
        report.plot(first, args.plot, title=f"Extra host memory per node, S = {args.size_mb:g} MiB, K = {args.units},"
                    f" {args.optimizer} (*-adam: Adam)")
        print(f"wrote {args.plot}")
    failed = [f"{r['config']} N={r['world_size']}" for r in runs if not r["ok"]]
    failed += [f"fit {f['config']} N={f['world_size']} every={f['every']}" for f in fits if not f["ok"]]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _skipped(names: List[str]) -> Dict[str, str]:
    """The chosen configurations this build cannot run, and why (printed after the tables and kept in the JSON)."""
    skipped = {}
    for name in names:
        missing = registry.missing_arguments(registry.by_name(name))
        if missing:
            skipped[name] = f"not in this build: DDPFullyShardedStrategy takes no {', '.join(missing)}"
            print(f"{name}: skipped, {skipped[name]}", flush=True)
    return skipped


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _versions() -> Dict[str, str]:
    from importlib import metadata

    versions = {}
    for name in ("torch", "fairscale"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "missing"
    import pytorch_lightning

    versions["pytorch_lightning"] = pytorch_lightning.__version__
    return versions


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def _memory_gb() -> float:
    try:
        import psutil

        return psutil.virtual_memory().total / 1024**3
    except ImportError:
        return 0.0


if __name__ == "__main__":
    sys.exit(main())
