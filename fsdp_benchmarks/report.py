"""Turn per-rank results into runs (the JSON schema), a table for stdout, and a plot.

Memory figures (see :mod:`fsdp_harness.memory_sampler`): **save** is anonymous memory plus mapped file pages
(``*_anon_file_mb``), the figure the save goal is stated in; **resume** is anonymous memory (``*_peak_extra_mb``),
with the mapped file pages beside it (``*_file_mb``): they are page cache of the one checkpoint file, shared by the
ranks of a node, so the node figure for them is the largest rank's, not a sum. Anonymous save figures stay in the
JSON too. ``node_save_x_s`` / ``node_load_x_s`` are the node save (anon + file) and resume (anon) figures in S.

``save_bytes_written`` is what the rank wrote into the checkpoint directory during the measured save (instrumented:
:mod:`fsdp_benchmarks.checkpoint_io_meter`). ``load_bytes_read`` is, for the fork's configurations, the bytes of
the checkpoint's tensors the strategy's loads read (:mod:`fsdp_harness.checkpoint_reads`), and for the torch DCP
peer the bytes its file reads returned (the meter). A run's ``write_mbps`` is set when the writes were throttled, an
emulated per-rank link, never a measured one.

A remote configuration's ranks (``storage`` ``"s3"``) also have ``save_server_sent``/``save_server_received`` and
``load_server_sent``/``load_server_received``: the bytes the rank sent to and received from the S3 server in the
measured save and resume, as its own proxy counted them (request and response bodies; what the ranks exchange over
gloo is not among them), with ``*_server_requests`` and, per S3 operation, ``*_server_by_op``; and
``client_setup_peak_extra_anon_file_mb``/``client_setup_seconds``: making the rank's S3 client before the fit, outside
the measured windows (a job pays it once).
"""
import json
from statistics import median as _median
from pathlib import Path
from typing import Any, Dict, List, Optional

#: What a run keeps per rank from ``rank<N>.json``'s ``save`` / ``load`` measurements, as ``save_<field>`` and
#: ``load_<field>`` (MiB, seconds, Hz; for the load also the bytes read of the checkpoint's tensors and passed through
#: collectives, the FSDP units gathered, and the seconds in the strategy's state loads); ``cuda_max_allocated_mb``
#: exists in GPU mode only.
_RANK_FIELDS = ("peak_extra_mb", "peak_extra_anon_file_mb", "peak_extra_file_mb", "seconds", "sample_hz",
                "cuda_max_allocated_mb", "stall_seconds", "first_stall_seconds", "bytes_read", "collective_bytes",
                "unit_gathers", "state_seconds", "bytes_written", "files_bytes", "io_seconds", "crc_seconds",
                "server_sent", "server_received", "server_requests", "server_by_op")
MIB = 1024 * 1024


def _rank_row(r: Dict[str, Any]) -> Dict[str, Any]:
    row: Dict[str, Any] = {"rank": r["rank"]}
    for phase, prefix in (("save", "save_"), ("load", "load_")):
        for field in _RANK_FIELDS:
            if field in r[phase]:
                row[prefix + field] = r[phase][field]
    for field in ("peak_extra_anon_file_mb", "seconds"):
        if field in r.get("client_setup", {}):
            row[f"client_setup_{field}"] = r["client_setup"][field]
    return row


def make_run(config: str, world_size: int, ranks: List[Dict[str, Any]], complete: bool = True) -> Dict[str, Any]:
    """One entry of ``{"runs": [...]}`` from the ``rank<N>.json`` results of one configuration and world size;
    ``complete``: whether the configuration's checkpoint is meant to hold the whole optimizer state."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    rank0 = ranks[0]
    size = rank0["state_dict_mb"]
    rows = [_rank_row(r) for r in ranks]
    node_save = sum(r["save_peak_extra_anon_file_mb"] for r in rows)
    node_load = sum(r["load_peak_extra_mb"] for r in rows)
    run = {
        "config": config,
        "world_size": world_size,
        "state_dict_mb": size,
        "ranks": rows,
        "node_save_peak_extra_anon_file_mb": node_save,
        "node_save_peak_extra_mb": sum(r["save_peak_extra_mb"] for r in rows),
        "node_load_peak_extra_mb": node_load,
        "node_load_peak_extra_file_mb": max(r["load_peak_extra_file_mb"] for r in rows),
        "node_save_x_s": node_save / size,
        "node_load_x_s": node_load / size,
        "checkpoint_mb": rank0["checkpoint_mb"],
        "complete_checkpoint": complete,
        "optimizer_state_complete": rank0["save_check"]["optimizer_state_complete"],
        "ok": bool(rank0["ok"]),
        "units": rank0["units"],
        "heads": rank0.get("heads", 0),
        "optimizer": rank0.get("optimizer"),
        "unit_mb": rank0["unit_mb"],
        "accelerator": rank0["accelerator"],
        "memory_source": rank0["memory_source"],
        "lightning_version": rank0["lightning_version"],
        "mismatched": rank0["save_check"]["mismatched"] + rank0["load_check"]["mismatched"],
    }
    if "stream_check" in rank0:
        run["stream_check"] = {k: rank0["stream_check"][k] for k in ("compared", "mismatched")}
    if "tensor_check" in rank0:
        run["tensor_check"] = {k: rank0["tensor_check"][k] for k in ("compared", "mismatched")}
    return run


def failed_run(config: str, world_size: int, size_mb: float, reason: str) -> Dict[str, Any]:
    return {
        "config": config,
        "world_size": world_size,
        "state_dict_mb": size_mb,
        "ranks": [],
        "node_save_peak_extra_anon_file_mb": None,
        "node_save_peak_extra_mb": None,
        "node_load_peak_extra_mb": None,
        "checkpoint_mb": None,
        "ok": False,
        "error": reason,
    }


def _mib(row: Dict[str, Any], key: str) -> str:
    return f"{row[key] / MIB:.1f}" if key in row else ""


def _x(value: float, size: float) -> str:
    return f"{value:.1f} ({value / size:.2f}x)"


def _gpu(runs: List[Dict[str, Any]]) -> bool:
    return any("save_cuda_max_allocated_mb" in r for run in runs for r in run["ranks"])


def _optimizer_state(run: Dict[str, Any]) -> str:
    if run["optimizer_state_complete"]:
        return "complete"
    return "INCOMPLETE" if not run["complete_checkpoint"] else "MISSING"


def _rows(runs: List[Dict[str, Any]]) -> List[List[str]]:
    """The table's cells: a row per rank and a node row per run (the node's mapped-file figure is the largest
    rank's, as the ranks share those pages)."""
    gpu = _gpu(runs)
    rows = []
    for run in runs:
        size = run["state_dict_mb"]
        head = [run["config"], str(run["world_size"])]
        if not run["ranks"]:
            rows.append(head + ["FAILED: " + run.get("error", "")])
            continue
        for r in run["ranks"]:
            cells = [str(r["rank"]), _x(r["save_peak_extra_anon_file_mb"], size), f"{r['save_peak_extra_mb']:.1f}",
                     f"{r['save_seconds']:.2f}", _mib(r, "save_bytes_written"), _x(r["load_peak_extra_mb"], size),
                     f"{r['load_peak_extra_file_mb']:.1f}", f"{r['load_seconds']:.2f}", _mib(r, "load_bytes_read"),
                     _mib(r, "load_collective_bytes")]
            if gpu:
                cells += [
                    f"{r.get('save_cuda_max_allocated_mb', 0):.1f}", f"{r.get('load_cuda_max_allocated_mb', 0):.1f}"
                ]
            rows.append(head + cells + ["", "", ""])
        stream = run.get("stream_check")
        ok = ("yes" if run["ok"] else "NO") + (f", {stream['compared']} tensors = gathered" if stream else "")
        loaded = run.get("tensor_check")
        ok += f", {loaded['compared']} shards loaded = saved" if loaded else ""
        cells = ["node", _x(run["node_save_peak_extra_anon_file_mb"], size),
                 f"{run['node_save_peak_extra_mb']:.1f}", "", "",
                 _x(run["node_load_peak_extra_mb"], size), f"{run['node_load_peak_extra_file_mb']:.1f}", "", "", ""]
        if gpu:
            cells += ["", ""]
        rows.append(head + cells + [f"{run['checkpoint_mb']:.1f}", _optimizer_state(run), ok])
    return rows


def _header(runs: List[Dict[str, Any]]) -> List[str]:
    gpu = ["GPU save MiB", "GPU resume MiB"] if _gpu(runs) else []
    return ["config", "N", "rank", "save anon+file MiB (xS)", "anon", "save s", "save written MiB",
            "resume anon MiB (xS)", "mapped file",
            "resume s", "resume read MiB", "resume collectives MiB", *gpu, "ckpt MiB", "optimizer state", "ok"]


def table(runs: List[Dict[str, Any]]) -> str:
    """Per-rank rows and a node total per run, aligned for stdout."""
    header = _header(runs)
    rows = _rows(runs)
    widths = [
        max([len(header[i])] + [len(row[i]) for row in rows if len(row) == len(header)]) for i in range(len(header))
    ]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append("-" * len(lines[0]))
    for row in rows:
        cells = "  ".join(c.rjust(w) for c, w in zip(row, widths)) if len(row) == len(header) else "  ".join(row)
        lines.append(cells.rstrip())
        if row[2] == "node" or len(row) != len(header):
            lines.append("")
    return "\n".join(lines)


def _synchronous_twin(config: str) -> str:
    # ``fork-async`` against ``fork-stream``, ``fork-async-adam`` against ``fork-stream-adam``, ``fork-s3-async``
    # against ``fork-s3``
    return config.replace("fork-async", "fork-stream").replace("fork-s3-async", "fork-s3")


def stall_table(runs: List[Dict[str, Any]]) -> str:
    """For each run, the training thread's stall per save (the slowest rank's), the time until the file was committed
    and, for a save in the background, the stall as a fraction of the synchronous streamed save of the same run
    (``fork-async`` against ``fork-stream`` at the same N)."""
    saves = {(r["config"], r["world_size"]): max(x["save_seconds"] for x in r["ranks"]) for r in runs if r["ranks"]}
    header = f"{'config':>18}  {'N':>2}  {'stall s':>8}  {'commit s':>8}  {'stall / synchronous save':>24}"
    lines = [header + f"  {'first save stall s':>18}"]
    for run in runs:
        if not run["ranks"] or "save_stall_seconds" not in run["ranks"][0]:
            continue
        stall = max(x["save_stall_seconds"] for x in run["ranks"])
        commit = saves[(run["config"], run["world_size"])]
        twin = saves.get((_synchronous_twin(run["config"]), run["world_size"]))
        ratio = f"{stall / twin:.3f} (of {twin:.2f} s)" if twin and twin != commit else ""
        first = [x["save_first_stall_seconds"] for x in run["ranks"] if "save_first_stall_seconds" in x]
        first_cell = f"{max(first):.3f}" if first else ""
        lines.append(
            f"{run['config']:>18}  {run['world_size']:>2}  {stall:>8.3f}  {commit:>8.2f}  {ratio:>24}  {first_cell:>18}"
        )
    return "\n".join(lines)


def save_time_table(runs: List[Dict[str, Any]], write_mbps: Any = None) -> str:
    """The save time (the slowest rank's) of each configuration against N, one column per world size run, and the
    most any rank wrote; under ``--write-mbps`` labelled as the emulation it is."""
    runs = [r for r in runs if r["ranks"]]
    sizes = sorted({r["world_size"] for r in runs})
    cap = f"emulated per-rank write link of {write_mbps:g} MB/s" if write_mbps else "writes not throttled"
    lines = [f"save s against N ({cap}; most written by one rank, MiB)",
             f"{'config':>30}" + "".join(f"  {'N=' + str(n):>16}" for n in sizes)]
    for config in dict.fromkeys(r["config"] for r in runs):
        cells = []
        for n in sizes:
            run = next((r for r in runs if r["config"] == config and r["world_size"] == n), None)
            cells.append(_save_cell(run) if run else "")
        lines.append(f"{config:>30}" + "".join(f"  {c:>16}" for c in cells))
    return "\n".join(lines)


def _save_cell(run: Dict[str, Any]) -> str:
    seconds = max(r["save_seconds"] for r in run["ranks"])
    written = [r["save_bytes_written"] for r in run["ranks"] if "save_bytes_written" in r]
    return f"{seconds:.2f} ({max(written) / MIB:.0f})" if written else f"{seconds:.2f}"


def slowest_save_seconds(run: Dict[str, Any]) -> float:
    """The save time of the run's slowest rank."""
    return max(r["save_seconds"] for r in run["ranks"])


def _outside_io_seconds(run: Dict[str, Any]) -> Optional[float]:
    """The most any rank's save spent outside its writes and syncs of the checkpoint's files."""
    ranks = [r for r in run["ranks"] if "save_io_seconds" in r]
    return max(r["save_seconds"] - r["save_io_seconds"] for r in ranks) if ranks else None


def median_save_table(runs: List[Dict[str, Any]]) -> str:
    """Each configuration's save time at each N (the slowest rank's), the median of its repeated runs (run in
    alternating order), with the median time outside the checkpoint's writes and syncs, and the ratio of the median
    to that of the torch DCP peer with the same optimizer at the same N in the same invocation."""
    runs = [r for r in runs if r["ranks"]]
    groups: Dict[Any, List[Dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["config"], run["world_size"]), []).append(run)
    medians = {key: _median([slowest_save_seconds(r) for r in group]) for key, group in groups.items()}
    header = (
        f"{'config':>30}  {'N':>2}  {'runs':>4}  {'median save s':>13}  {'outside I/O s':>13}  {'x DCP':>6}  save s"
    )
    lines = ["save s, median of the repeated runs (slowest rank; outside I/O: writes and syncs of the checkpoint"
             " excluded)", header]
    for (config, n), group in groups.items():
        peer = next(
            (medians[key] for key, other in groups.items()
             if key[1] == n and key[0].startswith("dcp") and other[0].get("optimizer") == group[0].get("optimizer")
             and other[0].get("storage", "local") == group[0].get("storage", "local")),
            None,
        )
        outside = [x for x in map(_outside_io_seconds, group) if x is not None]
        ratio = f"{medians[config, n] / peer:.2f}" if peer and not config.startswith("dcp") else ""
        lines.append(
            f"{config:>30}  {n:>2}  {len(group):>4}  {medians[config, n]:>13.3f}"
            f"  {(f'{_median(outside):.3f}' if outside else ''):>13}  {ratio:>6}  "
            + ", ".join(f"{slowest_save_seconds(r):.3f}" for r in group)
        )
    return "\n".join(lines)


#: the suffix of a configuration that measures the one without it with no CRC-32s (see ``configs.BenchConfig``)
NO_CRC = "-no-crc"


def slowest_load_seconds(run: Dict[str, Any]) -> float:
    """The resume time of the run's slowest rank."""
    return max(r["load_seconds"] for r in run["ranks"])


def crc_cost_table(runs: List[Dict[str, Any]]) -> str:
    """What the CRC-32s cost: each configuration's median save and resume time (the slowest rank's, over its repeated
    runs) against its twin without them (``<config>-no-crc``) at the same N, in the same invocation, and the median
    of the most seconds a rank spent computing CRC-32s in each; empty where no configuration has its twin."""
    groups: Dict[Any, List[Dict[str, Any]]] = {}
    for run in (r for r in runs if r["ranks"]):
        groups.setdefault((run["config"], run["world_size"]), []).append(run)
    lines = []
    for (config, n), group in groups.items():
        twin = groups.get((config + NO_CRC, n))
        if config.endswith(NO_CRC) or twin is None:
            continue
        save, save_twin = (_median([slowest_save_seconds(r) for r in g]) for g in (group, twin))
        load, load_twin = (_median([slowest_load_seconds(r) for r in g]) for g in (group, twin))
        # the most any rank spent computing CRC-32s, in the save and in the resume
        crcs = [_median([max(r.get(f"{phase}_crc_seconds", 0.0) for r in run["ranks"]) for run in group])
                for phase in ("save", "load")]
        lines.append(
            f"{config:>24}  {n:>2}  {len(group):>4}  {save:>6.3f}  {save_twin:>8.3f}  {save / save_twin:>6.2f}"
            f"  {crcs[0]:>9.4f}  {load:>8.3f}  {load_twin:>10.3f}  {load / load_twin:>6.2f}  {crcs[1]:>9.4f}"
        )
    if not lines:
        return ""
    header = (
        f"{'config':>24}  {'N':>2}  {'runs':>4}  {'save s':>6}  {'no CRC s':>8}  {'x':>6}  {'CRC s':>9}"
        f"  {'resume s':>8}  {'no check s':>10}  {'x':>6}  {'CRC s':>9}"
    )
    title = "the CRC-32s' cost, medians (slowest rank): saves that write them and resumes that check them, against none"
    return "\n".join([title, header] + lines)


def fit_table(fits: List[Dict[str, Any]]) -> str:
    """The wall time of fits that save every K steps, against the same fit without saves (``every`` 0) at each N."""
    base = {f["world_size"]: f["fit_seconds"] for f in fits if f["every"] == 0}
    lines = [f"{'config':>18}  {'N':>2}  {'every':>5}  {'saves':>5}  {'fit s':>7}  {'x no saves':>10}  {'stall s':>8}"]
    for fit in fits:
        stalls = sorted(fit["stalls"])
        median = f"{stalls[len(stalls) // 2]:.3f}" if stalls else ""
        ratio = f"{fit['fit_seconds'] / base[fit['world_size']]:.2f}" if base.get(fit["world_size"]) else ""
        name = fit["config"] if fit["every"] else "no checkpoints"
        lines.append(
            f"{name:>18}  {fit['world_size']:>2}  {fit['every']:>5}  {len(stalls):>5}  {fit['fit_seconds']:>7.2f}"
            f"  {ratio:>10}  {median:>8}"
        )
    return "\n".join(lines)


#: the remote configurations whose save times :func:`remote_table` compares: the fork's default, and the DCP peer
REMOTE_RATIO = ("fork-s3", "dcp-fsspec-s3")


def _f_over_n(value: float, run: Dict[str, Any]) -> str:
    share = run["checkpoint_mb"] * MIB / run["world_size"]
    return f"{value / MIB:.1f} ({value / share:.2f})"


def remote_table(runs: List[Dict[str, Any]]) -> str:
    """The remote configurations (the ranks with ``save_server_sent``): per configuration and N, the slowest rank's
    save and resume seconds, the largest rank's extra memory in the save (anon + file) and the resume (anon) in MiB
    and in F (the run's checkpoint: the object, or DCP's objects), then per rank the bytes it sent to the server while
    saving and received from it while resuming, in MiB and in F/N; and the ratio of ``fork-s3``'s save time to
    ``dcp-fsspec-s3``'s at each N; below, the most any rank's S3 client took to make, outside the measured windows.
    Empty without remote runs."""
    runs = [r for r in runs if r["ranks"] and all("save_server_sent" in x for x in r["ranks"])]
    if not runs:
        return ""
    header = (
        f"{'config':>14}  {'N':>2}  {'F MiB':>7}  {'save s':>7}  {'resume s':>8}  {'save extra MiB (xF)':>19}"
        f"  {'resume extra MiB (xF)':>21}  {'rank':>4}  {'sent saving MiB (xF/N)':>22}"
        f"  {'received resuming MiB (xF/N)':>28}"
    )
    lines = [
        "object storage (s3://, moto through a proxy per rank): slowest rank's seconds, largest rank's extra memory;"
        " per rank the bytes sent to / received from the server (gloo traffic between ranks not counted)",
        header,
    ]
    for run in runs:
        size = run["checkpoint_mb"]
        save_mem = max(x["save_peak_extra_anon_file_mb"] for x in run["ranks"])
        load_mem = max(x["load_peak_extra_mb"] for x in run["ranks"])
        for i, rank in enumerate(run["ranks"]):
            head = (
                f"{run['config']:>14}  {run['world_size']:>2}  {size:>7.1f}  {slowest_save_seconds(run):>7.2f}"
                f"  {slowest_load_seconds(run):>8.2f}  {_x(save_mem, size):>19}  {_x(load_mem, size):>21}"
                if i == 0 else " " * (14 + 2 + 2 + 2 + 7 + 2 + 7 + 2 + 8 + 2 + 19 + 2 + 21)
            )
            lines.append(
                f"{head}  {rank['rank']:>4}  {_f_over_n(rank['save_server_sent'], run):>22}"
                f"  {_f_over_n(rank['load_server_received'], run):>28}"
            )
    ratios = []
    for n in sorted({r["world_size"] for r in runs}):
        fork, peer = (next((r for r in runs if r["config"] == c and r["world_size"] == n), None) for c in REMOTE_RATIO)
        if fork and peer:
            fork_s, peer_s = slowest_save_seconds(fork), slowest_save_seconds(peer)
            ratios.append(f"N={n}: {fork_s / peer_s:.2f} ({fork_s:.2f} s / {peer_s:.2f} s)")
    if ratios:
        lines.append(f"{REMOTE_RATIO[0]} save s / {REMOTE_RATIO[1]} save s: " + "; ".join(ratios))
    setup = [x["client_setup_peak_extra_anon_file_mb"] for r in runs for x in r["ranks"]
             if "client_setup_peak_extra_anon_file_mb" in x]
    if setup:
        lines.append(f"making a rank's S3 client, before the fit and not in the figures above: up to {max(setup):.1f}"
                     " MiB anon+file")
    return "\n".join(lines)


def markdown_table(runs: List[Dict[str, Any]]) -> str:
    header = _header(runs)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in _rows(runs):
        if len(row) == len(header) and row[2] == "node":
            row = [f"**{c}**" if c else c for c in row]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_json(runs: List[Dict[str, Any]], path: Path, meta: Dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": runs, "meta": meta}, indent=1) + "\n")


def plot(runs: List[Dict[str, Any]], path: Path, title: str = "") -> None:
    """Node extra memory against N, a line per configuration: save (anon + file) and resume (anon) panels, y in S,
    a dashed line at 1 x S."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in runs if r["ranks"]]
    sizes = sorted({r["world_size"] for r in runs})
    configs = list(dict.fromkeys(r["config"] for r in runs))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8), sharex=True)
    panels = (("save: anonymous + mapped file pages", "node_save_x_s"), ("resume: anonymous", "node_load_x_s"))
    for ax, (label, key) in zip(axes, panels):
        for config in configs:
            points = sorted((r["world_size"], r[key]) for r in runs if r["config"] == config)
            incomplete = any(not r["complete_checkpoint"] for r in runs if r["config"] == config)
            ax.plot(*zip(*points), marker="o", linestyle=":" if incomplete else "-",
                    label=config + (" (incomplete checkpoint)" if incomplete else ""))
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="1 x S")
        ax.set_xticks(sizes)
        ax.set_xlabel("N (ranks on the node)")
        ax.set_ylabel("node extra memory (x S)")
        ax.set_title(label)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    size_mb = runs[0]["state_dict_mb"] if runs else 0
    fig.suptitle(title or f"Extra host memory per node during save_checkpoint and resume, S = {size_mb:.0f} MiB")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    # ``python -m fsdp_benchmarks.report RESULT.json [--plot OUT.png]``: the markdown table used in
    # docs/checkpoint_memory.md, the medians of repeated runs (``--repeat``) where it has them, and the plot drawn
    # again from saved results.
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fsdp_benchmarks.report")
    parser.add_argument("result", type=Path, help="a --json file of the benchmark")
    parser.add_argument("--plot", type=Path, help="also draw the plot into this PNG")
    args = parser.parse_args()
    saved = json.loads(args.result.read_text())
    print(markdown_table(saved["runs"]))
    if any(run.get("repeat", 0) > 0 for run in saved["runs"]):
        print()
        print(median_save_table(saved["runs"]))
    if crc_cost_table(saved["runs"]):
        print()
        print(crc_cost_table(saved["runs"]))
    if remote_table(saved["runs"]):
        print()
        print(remote_table(saved["runs"]))
    if args.plot:
        plot(saved["runs"], args.plot)
