#!/usr/bin/env bash
# GPU check: the standalone (GPU) tests, the gathered, streamed and asynchronous Adam benchmark configurations on
# CUDA, and the pinned host allocator's rounding that asynchronous saves' host-memory check predicts, in under 9 min.
#
# Run from the repository root after README.md's setup (with the CUDA build of torch installed first); it installs
# nothing. With 2+ GPUs the benchmark's state dict and optimizer state are gathered through NCCL on 2 ranks; with
# 1 GPU it takes the 1-GPU path (the standalone tests that need 2 GPUs skip themselves).
#
#   bash tools/gpu_check.sh [--dry-run] [--cpu-fallback] [--out DIR]
#
#   --dry-run       print what would run, write the summary, run nothing
#   --cpu-fallback  on a machine without CUDA, run the same steps on CPU instead of failing (the standalone tests
#                   then all skip; the benchmark runs on 2 CPU ranks over gloo, smaller)
#   --out DIR       where the summary and benchmark JSON go (default: gpu-check/)
# PYTHON selects the interpreter (default: .venv/bin/python). Exit status is non-zero if a step failed.
set -uo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
# The benchmark package, named in this one place.
BENCH_MODULE="fsdp_benchmarks.checkpoint_memory"
# What the host-memory check of asynchronous saves predicts for pinned buffers, against torch's pinned allocator.
PINNED_MODULE="fsdp_benchmarks.pinned_host_rounding"
STANDALONE_TIMEOUT=360  # the standalone tests together
BENCH_TIMEOUT=150
PINNED_TIMEOUT=60

dry_run=0
cpu_fallback=0
out=gpu-check
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --cpu-fallback) cpu_fallback=1 ;;
        --out) out="$2"; shift ;;
        *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$out"
summary="$out/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }

if [ "$dry_run" -eq 1 ]; then
    gpus="${GPU_CHECK_GPUS:-2}"
else
    gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null) || gpus=0
fi

if [ "$gpus" -ge 1 ]; then
    accelerator=gpu
    devices=$([ "$gpus" -ge 2 ] && echo 2 || echo 1)
    bench=("$PYTHON" -m "$BENCH_MODULE" --accelerator gpu --devices "$devices" --configs fork-adam,fork-stream-adam,fork-async-adam
           --size-mb 64 --units 8 --json "$out/benchmark.json")
elif [ "$cpu_fallback" -eq 1 ]; then
    accelerator=cpu
    devices=2
    bench=("$PYTHON" -m "$BENCH_MODULE" --accelerator cpu --devices 2 --configs fork-adam,fork-stream-adam,fork-async-adam
           --size-mb 16 --units 4 --json "$out/benchmark.json")
else
    note "gpu_check: no CUDA device visible to $PYTHON; nothing checked (use --cpu-fallback or --dry-run)"
    exit 1
fi
standalone=(env PYTHON="$PYTHON" PL_STANDALONE_TIMEOUT=300 bash tests/standalone_tests.sh)
pinned=("$PYTHON" -m "$PINNED_MODULE")  # skips itself (exit 0) without CUDA

note "gpu_check: $(date -u +%FT%TZ), GPUs: $gpus, accelerator: $accelerator, benchmark ranks: $devices$([ "$dry_run" -eq 1 ] && echo ', dry run')"
start=$SECONDS
rc=0
step() {  # step NAME TIMEOUT CMD...
    local name=$1 limit=$2
    shift 2
    if [ "$dry_run" -eq 1 ]; then
        note "would run ($name, timeout ${limit}s): $*"
        return
    fi
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
    local status=$?
    [ "$status" -eq 0 ] || rc=1
    note "$name: $([ "$status" -eq 0 ] && echo ok || echo "FAILED (exit $status)") in $((SECONDS - t0)) s; log: $out/$name.log"
    grep -E "^=== standalone summary|^FAILED |^pinned_host_rounding: " "$out/$name.log" | sed 's/^/  /' |
        tee -a "$summary"
}

step standalone "$STANDALONE_TIMEOUT" "${standalone[@]}"
step benchmark "$BENCH_TIMEOUT" "${bench[@]}"
step pinned_rounding "$PINNED_TIMEOUT" "${pinned[@]}"
note "gpu_check: $([ "$rc" -eq 0 ] && echo passed || echo FAILED) in $((SECONDS - start)) s"
exit "$rc"
