#!/usr/bin/env bash
# The test suite: unit tests, shader validation (naga, every kernel variant), the conformance
# suite on every backend present (lavapipe where there is no GPU), the CLI, and the portability
# report as a gate (exit 3 on any contract break). Ends with one summary line.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --all-targets "$@" 2>&1 | tee "$log"
./target/debug/mantissa report --backends reference,wgpu --train-steps 20 --out target/report
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
