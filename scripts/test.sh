#!/usr/bin/env bash
# The whole test suite: Rust unit/property/loopback tests, Python tests
# (real processes and sockets), and bounded fuzzing of every parser.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
status=0

echo "== cargo test (workspace) =="
cargo test --workspace --exclude fanin-py || status=1

echo "== pytest =="
# the slowest tests are listed, so CI time stays visible (keep the whole under 30 min)
"$PY" -m pytest python/tests -q --durations=15 || status=1

echo "== fuzz (${FUZZ_SECONDS:-15} s per target) =="
scripts/fuzz.sh "${FUZZ_SECONDS:-15}" || status=1

if [ $status = 0 ]; then echo "test.sh: all suites passed"; else echo "test.sh: FAILED"; fi
exit $status
