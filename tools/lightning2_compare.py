"""The PASS/FAIL lines of ``tools/lightning2_check.sh``: compares what the fits of ``tools/lightning2_resume.py`` wrote
(in either environment; it needs torch only, not Lightning).

    python -m tools.lightning2_compare NAME --run DIR [--file CKPT] [--reference CKPT] [--atol A] [--rtol R]

prints one line: ``PASS NAME: ...`` or ``FAIL NAME: ...`` (exit 1) with the numbers. Checked: the run in ``DIR``
succeeded; with ``--file`` (the checkpoint it resumed from), its optimizer state right after the restore was the
file's (not started fresh), and the file's loop and callback states that its Lightning skips are named; with
``--reference``, its final weights and optimizer state equal the reference's, exactly or within
``atol + rtol * max |reference weight|``.
"""
import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch


def _load(path: Path) -> Dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def _max_difference(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], what: str) -> Tuple[float, List[str]]:
    """The largest absolute difference over the tensors of ``a`` and ``b`` (flattened dicts), and what differs in
    structure (missing keys, shapes)."""
    problems = [f"{what}: {key} only in one" for key in sorted(set(a) ^ set(b))]
    worst = 0.0
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if x != y:
                problems.append(f"{what}: {key} {x!r} != {y!r}")
            continue
        if x.shape != y.shape:
            problems.append(f"{what}: {key} shape {tuple(x.shape)} != {tuple(y.shape)}")
            continue
        worst = max(worst, (x.double() - y.double()).abs().max().item() if x.numel() else 0.0)
    return worst, problems


def _flat_optimizer(state: Dict[str, Any]) -> Dict[str, Any]:
    """``optimizer.state_dict()`` as ``{"state.<idx>.<key>": tensor, "group<g>.<hyperparameter>": value}``; any
    other layout (e.g. the fork's older ``fsdp_roots``) is reported by its top-level keys."""
    if set(state) - {"state", "param_groups", "param_names"}:
        return {"layout": sorted(state)}
    flat = {f"state.{idx}.{key}": value for idx, entry in state["state"].items() for key, value in entry.items()}
    for g, group in enumerate(state["param_groups"]):
        flat.update({f"group{g}.{key}": value for key, value in group.items()})
    return flat


def _layout(optimizer_state: Dict[str, Any]) -> List[str]:
    # without ``param_names``, the name-keyed view that the fork's FSDP files add to the plain layout
    return sorted(set(optimizer_state) - {"param_names"})


def _compare_checkpoints(run: Dict[str, Any], reference: Dict[str, Any], atol: float, rtol: float) -> Tuple[bool, str]:
    weights, problems = _max_difference(run["state_dict"], reference["state_dict"], "weights")
    run_optimizer, reference_optimizer = run["optimizer_states"][0], reference["optimizer_states"][0]
    if _layout(run_optimizer) != _layout(reference_optimizer):
        optimizer = 0.0
        problems.append(f"optimizer state layout {_layout(run_optimizer)} != {_layout(reference_optimizer)}")
    else:
        optimizer, optimizer_problems = _max_difference(
            _flat_optimizer(run_optimizer), _flat_optimizer(reference_optimizer), "optimizer"
        )
        problems += optimizer_problems
    scale = max((t.abs().max().item() for t in reference["state_dict"].values() if t.numel()), default=1.0)
    close = max(weights, optimizer) <= atol + rtol * scale
    detail = f"max |diff| weights {weights:.3g}, optimizer state {optimizer:.3g}"
    if problems:
        detail += f"; {len(problems)} differences, first: {problems[0]}"
    return close and not problems, detail


def _loaded_from_file(loaded: Optional[Dict[str, Any]], file: Dict[str, Any]) -> Tuple[bool, str]:
    """Whether the optimizer state right after the restore is the file's (a single-device run: equal tensors), or
    at least not fresh (a sharded run: every parameter has state, Adam's ``step`` equal to the file's)."""
    if not loaded or not loaded["state"]:
        return False, "the optimizer state started fresh (empty after the restore)"
    expected = file["optimizer_states"][0]
    difference, problems = _max_difference(_flat_optimizer(loaded), _flat_optimizer(expected), "loaded")
    if not problems:
        ok = difference == 0.0
        return ok, f"state of {len(loaded['state'])} parameters as in the file (max |diff| {difference:.3g})"
    # Sharded: FSDP's flat parameters, not comparable one to one; Adam's step counts must be the file's.
    steps = sorted({float(s["step"]) for s in loaded["state"].values() if "step" in s})
    file_steps = sorted({float(s["step"]) for s in expected.get("state", {}).values() if "step" in s})
    return steps == file_steps, f"state of {len(loaded['state'])} flat parameters, steps {steps} (file: {file_steps})"


def _not_restored(file: Dict[str, Any], restored: Dict[str, Any]) -> List[str]:
    """What of the file's progress and ``ModelCheckpoint`` state the run did not take (the run's loops or callbacks
    did not find it under the names they restore)."""
    model_checkpoints = [s for key, s in file.get("callbacks", {}).items() if str(key).startswith("ModelCheckpoint")]
    expected = {
        "global_step": file["global_step"],
        "epoch": file["epoch"],
        "best_model_path": model_checkpoints[0]["best_model_path"] if model_checkpoints else "",
    }
    return [f"{key} {restored[key]!r} after the restore, {value!r} in the file"
            for key, value in expected.items() if restored[key] != value]


def check(args: argparse.Namespace) -> bool:
    error = args.run / "error.txt"
    if error.exists():
        last = [line for line in error.read_text().splitlines() if line.strip()][-1]
        print(f"FAIL {args.name}: the run raised {last}")
        return False
    if not (args.run / "last.ckpt").exists():
        print(f"FAIL {args.name}: the run wrote no checkpoint (killed or timed out?)")
        return False
    result = json.loads((args.run / "result.json").read_text())
    parts, ok = [], True
    if args.file:
        file = _load(args.file)
        loaded_ok, detail = _loaded_from_file(_load(args.run / "loaded.pt"), file)
        not_restored = _not_restored(file, result["restored"])
        ok &= loaded_ok and not not_restored
        parts += [detail, *(not_restored or ["loops and ModelCheckpoint restored"])]
    if args.reference:
        same, detail = _compare_checkpoints(_load(args.run / "last.ckpt"), _load(args.reference), args.atol, args.rtol)
        ok &= same
        parts.append(f"vs {args.reference.parent.name}: {detail}")
    parts += [f"warning: {w}" for w in result["warnings"]]
    print(f"{'PASS' if ok else 'FAIL'} {args.name}: global_step {result['global_step']}; " + "; ".join(parts))
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name")
    parser.add_argument("--run", type=Path, required=True, help="the out folder of a fit")
    parser.add_argument("--file", type=Path, help="the checkpoint the run resumed from")
    parser.add_argument("--reference", type=Path, help="the last.ckpt that the run's must equal")
    parser.add_argument("--atol", type=float, default=0.0)
    parser.add_argument("--rtol", type=float, default=0.0)
    sys.exit(0 if check(parser.parse_args()) else 1)


if __name__ == "__main__":
    main()
