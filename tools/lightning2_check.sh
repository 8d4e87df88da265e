#!/usr/bin/env bash
# Lightning 2.6 check: does a checkpoint cross between the fork and Lightning 2.6, weights AND optimizer state?
#
# Lightning 2.6 cannot live in the suite's environment (both are `pytorch_lightning`), so this script builds its own
# virtual environment for it (torch==2.13.0, as the suite's, and lightning==2.6.*, from the package index) and runs
# the same LightningModule (tools/lightning2_resume.py; SGD with momentum, then Adam) in both environments:
#
#   fork FSDP file -> fork, 1 device         the fork's FSDP on 2 CPU ranks writes k steps; the fork resumes it
#   fork FSDP file -> Lightning 2.6          Trainer(accelerator="cpu", devices=1).fit(model, ckpt_path=<that file>):
#                                            the optimizer state right after the restore is the file's, and the
#                                            weights and optimizer state after m more steps equal the fork's, exactly
#   Lightning 2.6 file -> fork FSDP          a Lightning 2.6 single-device file resumed by the fork's FSDP on 2 ranks:
#                                            its optimizer state is loaded (not fresh), and m steps later it equals
#                                            Lightning 2.6's own resume up to the rounding of 2 ranks
#   Lightning 2.6 FSDP file -> fork FSDP     the same for a FSDPStrategy(state_dict_type="full") file (name-keyed
#                                            optimizer state); torch's FSDP needs an accelerator, so without CUDA the
#                                            file is the single-device one with its optimizer state keyed by name
#                                            through torch's get_optimizer_state_dict(full_state_dict=True), which
#                                            is what that strategy writes
# Each line also names the file's loop and callback states that the resuming Lightning skips.
#
#   bash tools/lightning2_check.sh [--dry-run] [--out DIR] [--venv DIR]
#
#   --dry-run   print what would run, write the summary, run (and install) nothing
#   --out DIR   where the runs, their logs and summary.txt go (default: lightning2-check/)
#   --venv DIR  Lightning 2.6's environment, built there if it has no bin/python, reused otherwise
#               (default: <out>/venv)
# PYTHON selects the fork's interpreter (default: .venv/bin/python), BASE_PYTHON the one that makes the new
# environment (default: python3), LIGHTNING2 the requirement (default: lightning==2.6.*). Run from anywhere; the
# fork's side runs in the repository root after `python -m fork_tools materialize` or `pip install .`.
# Exit status is non-zero if a step or check failed.
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON="${PYTHON:-.venv/bin/python}"
BASE_PYTHON="${BASE_PYTHON:-python3}"
LIGHTNING2="${LIGHTNING2:-lightning==2.6.*}"
TORCH="torch==2.13.0"  # the suite's torch (requirements pin it through .ci/run); the same kernels on both sides
SCRIPT="tools/lightning2_resume.py"
INSTALL_TIMEOUT=900  # torch's CPU wheel is ~200 MB
FIT_TIMEOUT=240      # one fit: 2 CPU ranks, 4 steps per epoch
CHECK_TIMEOUT=60
ATOL=1e-6            # 2 ranks vs 1 device: the same sums in another order
RTOL=1e-5

dry_run=0
out=lightning2-check
venv=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --out) out="$2"; shift ;;
        --venv) venv="$2"; shift ;;
        *) echo "lightning2_check.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
venv="${venv:-$out/venv}"
summary="$out/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
rc=0

# run NAME TIMEOUT CMD...: a step whose output goes to <out>/NAME.log
run() {
    local name=$1 limit=$2
    shift 2
    if [ "$dry_run" -eq 1 ]; then
        note "would run ($name, timeout ${limit}s): $*"
        return 0
    fi
    local t0=$SECONDS status
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
    status=$?
    [ "$status" -eq 0 ] || note "$name: exit $status in $((SECONDS - t0)) s; log: $out/$name.log"
    return "$status"
}
# fork|l2 NAME ARGS...: a fit of tools/lightning2_resume.py in the fork's environment (repository root, CPU only)
# or in Lightning 2.6's (from the out folder, where the fork's pytorch_lightning/ is not importable)
fork() {
    local name=$1
    shift
    run "$name" "$FIT_TIMEOUT" env CUDA_VISIBLE_DEVICES= "$PYTHON" -m tools.lightning2_resume fit --out "$out/$name" "$@"
}
l2() {
    local name=$1
    shift
    (cd "$out" && run "$name" "$FIT_TIMEOUT" "$venv/bin/python" "$ROOT/$SCRIPT" fit --out "$out/$name" "$@")
}
# check NAME ARGS...: one PASS/FAIL line of the summary
check() {
    local name=$1
    shift
    if [ "$dry_run" -eq 1 ]; then
        note "would check ($name): $*"
        return
    fi
    timeout "$CHECK_TIMEOUT" "$PYTHON" -m tools.lightning2_compare "$name" "$@" 2>> "$out/checks.log" |
        tee -a "$summary"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
}

note "lightning2_check: $(date -u +%FT%TZ), fork: $PYTHON, Lightning 2.6 environment: $venv$([ "$dry_run" -eq 1 ] && echo ', dry run')"
start=$SECONDS
if [ ! -x "$venv/bin/python" ]; then
    if ! { run venv 60 "$BASE_PYTHON" -m venv "$venv" &&
        # torch first: with no torch installed, lightning's bare `torch` requirement would pull a CUDA build
        run install-torch "$INSTALL_TIMEOUT" "$venv/bin/python" -m pip install "$TORCH" &&
        run install-lightning "$INSTALL_TIMEOUT" "$venv/bin/python" -m pip install "$LIGHTNING2"; }; then
        note "lightning2_check: FAILED to build Lightning 2.6's environment"
        exit 1
    fi
fi
if [ "$dry_run" -eq 0 ]; then
    note "  fork: $("$PYTHON" -c 'import pytorch_lightning as pl, torch; print(pl.__version__, "torch", torch.__version__)' 2>&1)"
    note "  Lightning 2.6: $(cd "$out" && "$venv/bin/python" -c 'import lightning, torch; print(lightning.__version__, "torch", torch.__version__)' 2>&1)"
fi

for opt in sgd adam; do
    # fork FSDP file -> fork on 1 device, and -> Lightning 2.6 on 1 device
    fork "fork-fsdp-$opt" --strategy fork-fsdp --devices 2 --optimizer "$opt" --epochs 1
    fork "fork-resume-$opt" --optimizer "$opt" --epochs 2 --ckpt "$out/fork-fsdp-$opt/last.ckpt"
    l2 "l2-resume-fork-$opt" --optimizer "$opt" --epochs 2 --ckpt "$out/fork-fsdp-$opt/last.ckpt"
    check "fork FSDP file -> fork, 1 device ($opt)" --run "$out/fork-resume-$opt" --file "$out/fork-fsdp-$opt/last.ckpt"
    check "fork FSDP file -> Lightning 2.6, 1 device ($opt)" --run "$out/l2-resume-fork-$opt" \
        --file "$out/fork-fsdp-$opt/last.ckpt" --reference "$out/fork-resume-$opt/last.ckpt"

    # Lightning 2.6 single-device file -> fork FSDP on 2 ranks; the reference is Lightning 2.6's own resume
    l2 "l2-single-$opt" --optimizer "$opt" --epochs 1
    l2 "l2-resume-$opt" --optimizer "$opt" --epochs 2 --ckpt "$out/l2-single-$opt/last.ckpt"
    fork "fork-fsdp-from-l2-$opt" --strategy fork-fsdp --devices 2 --optimizer "$opt" --epochs 2 \
        --ckpt "$out/l2-single-$opt/last.ckpt"
    check "Lightning 2.6 file -> fork FSDP, 2 ranks ($opt)" --run "$out/fork-fsdp-from-l2-$opt" \
        --file "$out/l2-single-$opt/last.ckpt" --reference "$out/l2-resume-$opt/last.ckpt" --atol "$ATOL" --rtol "$RTOL"

    # Lightning 2.6 full FSDP file -> fork FSDP on 2 ranks
    l2fsdp="$out/l2-fsdp-$opt/last.ckpt"
    if ! l2 "l2-fsdp-$opt" --strategy fsdp --devices 2 --optimizer "$opt" --epochs 1; then
        note "  Lightning 2.6's FSDPStrategy did not run here ($(grep -E '^[A-Za-z]*Error' "$out/l2-fsdp-$opt/error.txt" 2>/dev/null | tail -1)); its file is emulated"
        l2fsdp="$out/l2-fsdp-emulated-$opt.ckpt"
        (cd "$out" && run "l2-fsdp-emulated-$opt" "$CHECK_TIMEOUT" "$venv/bin/python" "$ROOT/$SCRIPT" emulate-fsdp-full --optimizer "$opt" \
            "$out/l2-single-$opt/last.ckpt" "$l2fsdp")
    fi
    fork "fork-fsdp-from-l2-fsdp-$opt" --strategy fork-fsdp --devices 2 --optimizer "$opt" --epochs 2 --ckpt "$l2fsdp"
    check "Lightning 2.6 full FSDP file -> fork FSDP, 2 ranks ($opt)" --run "$out/fork-fsdp-from-l2-fsdp-$opt" \
        --file "$l2fsdp" --reference "$out/l2-resume-$opt/last.ckpt" --atol "$ATOL" --rtol "$RTOL"
done
note "lightning2_check: $([ "$rc" -eq 0 ] && echo passed || echo FAILED) in $((SECONDS - start)) s"
exit "$rc"
