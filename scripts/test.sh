#!/usr/bin/env bash
# The test suite: unit tests, shader validation (naga, every kernel variant), the conformance
# suite on every backend present (lavapipe where there is no GPU), the CLI, and the portability
# report as a gate (exit 3 on any contract break), the cooperative-matrix kernels and the
# conformance suite again on Mesa 26's lavapipe, which has cooperative matrices
# (scripts/lavapipe-coop.sh), and the browser demo in headless Chromium (WebGPU on SwiftShader:
# scripts/web.sh test). Ends with one summary line.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# Tests that skip say so here (tests/common: `skip`); listed after the run.
skipped=target/tmp/skipped.txt
# The fuzz suite (tests/fuzz.rs) counts the inputs it tried here.
fuzzed=target/tmp/fuzz.txt
rm -f "$skipped" "$fuzzed"
cargo test --all-targets "$@" 2>&1 | tee "$log"
# The conformance tests of an absent CUDA backend pass as skipped; say why once, here.
./target/debug/mantissa info 2>/dev/null | grep '^cuda:' | tee -a "$log" || true
./target/debug/mantissa report --backends reference,wgpu --train-steps 20 --out target/report
if command -v dpkg-deb >/dev/null && [ "$(uname -m)" = x86_64 ]; then
    bash scripts/lavapipe-coop.sh cargo test --test coop --test conformance "$@" 2>&1 | tee -a "$log"
    echo "cooperative matrices: passed" >> "$log"
else
    echo "SKIPPED cooperative matrices: scripts/lavapipe-coop.sh needs Debian's dpkg-deb on x86_64" | tee -a "$log"
fi
if command -v apt-get >/dev/null || command -v chromium >/dev/null; then
    bash scripts/web.sh test --native target/debug/mantissa 2>&1 | tee -a "$log"
else
    echo "SKIPPED browser test: needs Debian's chromium, chromium-driver and python3-selenium" | tee -a "$log"
fi
if [ -s "$fuzzed" ]; then
    cat "$fuzzed"
    awk '{ n += $(NF-1) } END { printf "fuzz: %d inputs\n", n }' "$fuzzed" | tee -a "$log"
fi
if [ -s "$skipped" ]; then
    echo "Skipped (each test once):"
    sort -u "$skipped" | tee -a "$log"
fi
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     /^web test: PASSED/ { web = "browser: passed" } /^SKIPPED browser/ { web = "browser: skipped" }
     /^cooperative matrices: passed/ { coop = "coop matrices: passed" } /^SKIPPED cooperative/ { coop = "coop matrices: skipped" }
     /^fuzz: [0-9]+ inputs$/ { fuzz = "; " $0 }
     /^cuda: absent/ { cuda = "cuda: skipped (absent)" } /^cuda: [^a]/ { cuda = "cuda: ran" }
     /^SKIPPED / && !/^SKIPPED (browser|cooperative)/ { s++ }
     END { printf "tests: %d passed, %d failed, %d skipped%s; %s; %s; %s\n", p - s, f, s, fuzz, coop, web, cuda }' "$log"
