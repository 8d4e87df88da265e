"""Turn per-rank results into runs (the JSON schema), a table for stdout, and a plot."""
import json
from pathlib import Path
from typing import Any, Dict, List


def make_run(config: str, world_size: int, ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One entry of ``{"runs": [...]}`` from the ``rank<N>.json`` results of one configuration and world size."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    rank0 = ranks[0]
    size = rank0["state_dict_mb"]
    rows = [
        {
            "rank": r["rank"],
            "save_peak_extra_mb": r["save"]["peak_extra_mb"],
            "save_seconds": r["save"]["seconds"],
            "load_peak_extra_mb": r["load"]["peak_extra_mb"],
            "load_seconds": r["load"]["seconds"],
            "save_peak_extra_rss_mb": r["save"]["peak_extra_rss_mb"],
            "load_peak_extra_rss_mb": r["load"]["peak_extra_rss_mb"],
            "save_sample_hz": r["save"]["sample_hz"],
            "load_sample_hz": r["load"]["sample_hz"],
        }
        for r in ranks
    ]
    node_save = sum(r["save_peak_extra_mb"] for r in rows)
    node_load = sum(r["load_peak_extra_mb"] for r in rows)
    return {
        "config": config,
        "world_size": world_size,
        "state_dict_mb": size,
        "ranks": rows,
        "node_save_peak_extra_mb": node_save,
        "node_load_peak_extra_mb": node_load,
        "checkpoint_mb": rank0["checkpoint_mb"],
        "ok": bool(rank0["ok"]),
        "node_save_peak_extra_rss_mb": sum(r["save_peak_extra_rss_mb"] for r in rows),
        "node_load_peak_extra_rss_mb": sum(r["load_peak_extra_rss_mb"] for r in rows),
        "node_save_x_s": node_save / size,
        "node_load_x_s": node_load / size,
        "units": rank0["units"],
        "unit_mb": rank0["unit_mb"],
        "accelerator": rank0["accelerator"],
        "memory_source": rank0["memory_source"],
        "mismatched": rank0["save_check"]["mismatched"] + rank0["load_check"]["mismatched"],
    }


def failed_run(config: str, world_size: int, size_mb: float, reason: str) -> Dict[str, Any]:
    return {
        "config": config,
        "world_size": world_size,
        "state_dict_mb": size_mb,
        "ranks": [],
        "node_save_peak_extra_mb": None,
        "node_load_peak_extra_mb": None,
        "checkpoint_mb": None,
        "ok": False,
        "error": reason,
    }


def _fmt(value: Any, size: float) -> str:
    if value is None:
        return "-"
    return f"{value:9.1f} ({value / size:5.2f}x)"


def table(runs: List[Dict[str, Any]]) -> str:
    """Per-rank rows and a node total per run: anonymous-memory peaks in MiB and as x S, RSS beside them."""
    header = (
        f"{'config':<10} {'N':>2} {'rank':>5} | {'save extra MiB (xS)':>19} {'RSS':>7} {'s':>6} |"
        f" {'resume extra MiB (xS)':>21} {'RSS':>7} {'s':>6} | {'ckpt MiB':>8} ok"
    )
    lines = [header, "-" * len(header)]
    for run in runs:
        size = run["state_dict_mb"]
        if not run["ranks"]:
            lines.append(f"{run['config']:<10} {run['world_size']:>2} FAILED: {run.get('error', '')}")
            continue
        for r in run["ranks"]:
            lines.append(
                f"{run['config']:<10} {run['world_size']:>2} {r['rank']:>5} |"
                f" {_fmt(r['save_peak_extra_mb'], size):>19} {r['save_peak_extra_rss_mb']:7.1f} {r['save_seconds']:6.2f} |"
                f" {_fmt(r['load_peak_extra_mb'], size):>21} {r['load_peak_extra_rss_mb']:7.1f} {r['load_seconds']:6.2f} |"
                f" {'':>8}"
            )
        lines.append(
            f"{run['config']:<10} {run['world_size']:>2} {'node':>5} |"
            f" {_fmt(run['node_save_peak_extra_mb'], size):>19} {run['node_save_peak_extra_rss_mb']:7.1f} {'':>6} |"
            f" {_fmt(run['node_load_peak_extra_mb'], size):>21} {run['node_load_peak_extra_rss_mb']:7.1f} {'':>6} |"
            f" {run['checkpoint_mb']:8.1f} {'yes' if run['ok'] else 'NO'}"
        )
        lines.append("")
    return "\n".join(lines)


def markdown_table(runs: List[Dict[str, Any]]) -> str:
    lines = [
        "| config | N | rank | save extra MiB | x S | save s | resume extra MiB | x S | resume s | checkpoint MiB | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        size = run["state_dict_mb"]
        for r in run["ranks"]:
            lines.append(
                f"| {run['config']} | {run['world_size']} | {r['rank']} | {r['save_peak_extra_mb']:.1f} |"
                f" {r['save_peak_extra_mb'] / size:.2f} | {r['save_seconds']:.2f} | {r['load_peak_extra_mb']:.1f} |"
                f" {r['load_peak_extra_mb'] / size:.2f} | {r['load_seconds']:.2f} | | |"
            )
        if run["ranks"]:
            lines.append(
                f"| **{run['config']}** | **{run['world_size']}** | **node** | **{run['node_save_peak_extra_mb']:.1f}** |"
                f" **{run['node_save_peak_extra_mb'] / size:.2f}** | | **{run['node_load_peak_extra_mb']:.1f}** |"
                f" **{run['node_load_peak_extra_mb'] / size:.2f}** | | {run['checkpoint_mb']:.1f} | {run['ok']} |"
            )
    return "\n".join(lines)


def write_json(runs: List[Dict[str, Any]], path: Path, meta: Dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": runs, "meta": meta}, indent=1) + "\n")


def plot(runs: List[Dict[str, Any]], path: Path, title: str = "") -> None:
    """Grouped bars: node save and resume extra memory per configuration, one group per world size; line at 1 x S."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in runs if r["ranks"]]
    sizes = sorted({r["world_size"] for r in runs})
    configs = list(dict.fromkeys(r["config"] for r in runs))
    bars = [(c, kind) for c in configs for kind in ("save", "resume")]
    width = 0.8 / max(len(bars), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(bars) * len(sizes) + 2), 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (config, kind) in enumerate(bars):
        key = "node_save_peak_extra_mb" if kind == "save" else "node_load_peak_extra_mb"
        xs, ys = [], []
        for j, n in enumerate(sizes):
            match = [r for r in runs if r["config"] == config and r["world_size"] == n]
            if match:
                xs.append(j - 0.4 + width * (i + 0.5))
                ys.append(match[0][key])
        color = colors[configs.index(config) % len(colors)]
        ax.bar(xs, ys, width, color=color, hatch="" if kind == "save" else "//", alpha=1.0 if kind == "save" else 0.55,
               edgecolor="black", linewidth=0.5, label=f"{config}: {kind}")
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.0f}", (x, y), ha="center", va="bottom", fontsize=7)
    size_mb = runs[0]["state_dict_mb"] if runs else 0
    ax.axhline(size_mb, color="red", linestyle="--", linewidth=1, label=f"1 x S = {size_mb:.0f} MiB")
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels([f"N = {n}" for n in sizes])
    ax.set_ylabel("node extra anonymous memory (MiB)")
    ax.set_title(title or "Extra host memory per node during save_checkpoint and resume")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    # ``python -m fsdp_benchmarks.report RESULT.json``: the markdown table used in docs/checkpoint_memory.md.
    import sys

    print(markdown_table(json.loads(Path(sys.argv[1]).read_text())["runs"]))
