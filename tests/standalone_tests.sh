#!/usr/bin/env bash
# Run every standalone test (RunIf(standalone=True)) in its own process under coverage.
#
# Lightning 1.6's DDP launcher starts ranks >= 1 by re-running the command line, so a multi-process test must be
# the only test its pytest process runs. tests/conftest.py narrows collection to standalone tests when
# PL_RUN_STANDALONE_TESTS=1. Usage, from the repository root:  bash tests/standalone_tests.sh [pytest args...]
# PYTHON selects the interpreter (default: python). Exit status is non-zero if any test failed.
# Every test runs under a timeout (pytest-timeout, every rank): PL_STANDALONE_TIMEOUT seconds (default 900), or
# the caller's own --timeout=..., which comes later on the command line and wins.
set -uo pipefail

PYTHON="${PYTHON:-python}"
export PL_RUN_STANDALONE_TESTS=1

collected=$("$PYTHON" -m pytest tests --collect-only -q -p no:cacheprovider "$@")
collect_rc=$?
# Exit 5 means "no tests collected", which is fine here; anything else is a collection error.
if [ "$collect_rc" -ne 0 ] && [ "$collect_rc" -ne 5 ]; then
    echo "$collected"
    echo "standalone_tests.sh: collection failed (pytest exit $collect_rc)" >&2
    exit "$collect_rc"
fi
mapfile -t nodeids < <(printf '%s\n' "$collected" | grep '::' || true)

passed=()
failed=()
for nodeid in "${nodeids[@]}"; do
    echo "=== standalone: $nodeid"
    if "$PYTHON" -m coverage run --append -m pytest -v -p no:cacheprovider \
        --timeout="${PL_STANDALONE_TIMEOUT:-900}" "$nodeid" "$@"; then
        passed+=("$nodeid")
    else
        failed+=("$nodeid")
    fi
done

echo
echo "=== standalone summary: ${#nodeids[@]} collected, ${#passed[@]} passed, ${#failed[@]} failed"
for nodeid in "${failed[@]}"; do
    echo "FAILED $nodeid"
done
[ "${#failed[@]}" -eq 0 ]
