#!/usr/bin/env bash
# The test suite: unit tests, shader validation (naga, every kernel variant), the conformance
# suite on every backend present (lavapipe where there is no GPU), the CLI, and the portability
# report as a gate (exit 3 on any contract break), the cooperative-matrix kernels and the
# conformance suite again on Mesa 26's lavapipe, which has cooperative matrices
# (scripts/lavapipe-coop.sh), data-parallel training under mpirun (tests/mpi.rs; the `mpi`
# feature), the Python package (its wheel installed into a fresh venv,
# python/tests), and the browser demo in headless Chromium (WebGPU on SwiftShader:
# scripts/web.sh test). Ends with one summary line.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
log=$(mktemp)
# A process and its children, ended (the browser test's, where a stage beside it failed).
end_tree() {
    local child
    for child in $(pgrep -P "$1" 2>/dev/null); do end_tree "$child"; done
    kill "$1" 2>/dev/null || true
}
trap 'rm -f "$log"; [ -z "${web_pid:-}" ] || end_tree "$web_pid"' EXIT
# Tests that skip say so here (tests/common: `skip`); listed after the run.
skipped=target/tmp/skipped.txt
# The fuzz suite (tests/fuzz.rs) counts the inputs it tried here.
fuzzed=target/tmp/fuzz.txt
rm -f "$skipped" "$fuzzed"
# The examples as programs (tests/examples.rs runs them): `cargo test --all-targets` builds them
# only as test harnesses.
cargo build --examples --features mpi 2>&1 | tail -n 1
cargo test --all-targets --features mpi "$@" 2>&1 | tee "$log"
# The documentation's examples (the crate's quick start trains a model of its own).
cargo test --doc --features mpi "$@" 2>&1 | tee -a "$log"
# The conformance tests of an absent CUDA backend pass as skipped; say why once, here.
./target/debug/mantissa info 2>/dev/null | grep '^cuda:' | tee -a "$log" || true
# The gate: both backends named, so a wgpu that is absent fails it as a contract break does
# (one timed repetition and a few training steps: it checks numerics, it does not time them).
./target/debug/mantissa report --backends reference,wgpu --reps 1 --train-steps 5 --out target/report
# The browser test, beside the stages below: its page keeps one core busy (SwiftShader) for
# about ten minutes, and they can use the other. Its packages and wasm come first, in the
# foreground (no two apt or cargo runs at once); its output is told after the stages.
web_log=target/tmp/web.log
web_pid=
mkdir -p target/tmp
if command -v apt-get >/dev/null || command -v chromium >/dev/null; then
    bash scripts/web.sh prepare
    bash scripts/web.sh test --native target/debug/mantissa > "$web_log" 2>&1 &
    web_pid=$!
fi
if command -v dpkg-deb >/dev/null && [ "$(uname -m)" = x86_64 ]; then
    # The conformance suite's default wgpu backend, which runs the 16-bit matmuls on cooperative
    # matrices there; its variants (runtime checks, packed f16, rows on the GPU) run above.
    bash scripts/lavapipe-coop.sh cargo test --test coop --features mpi "$@" 2>&1 | tee -a "$log"
    bash scripts/lavapipe-coop.sh cargo test --test conformance --features mpi "$@" -- wgpu:: 2>&1 | tee -a "$log"
    # The step plans on cooperative matrices (their operand planes in idle slots and shared
    # between matmuls; their peak memory), the 16-bit coded tensors read by their kernels
    # there, bit for bit as stored in f32, and fused attention on them (attention_coop.wgsl).
    bash scripts/lavapipe-coop.sh cargo test --test train --features mpi "$@" -- resident coded fused_attention 2>&1 | tee -a "$log"
    echo "cooperative matrices: passed" >> "$log"
else
    echo "SKIPPED cooperative matrices: scripts/lavapipe-coop.sh needs Debian's dpkg-deb on x86_64" | tee -a "$log"
fi
# The Python package: the wheel built once (maturin, the dev profile and the features the tests
# use, so that it links the engine compiled above instead of compiling it again), installed with
# its dependencies into a fresh venv, and tested there (python/tests), not in the source tree.
if command -v python3 >/dev/null; then
    venv=target/py-venv
    rm -rf "$venv"
    python3 -m venv "$venv" 2>/dev/null || { apt-get install -y -qq python3-venv >/dev/null && python3 -m venv "$venv"; }
    "$venv/bin/pip" install -q --disable-pip-version-check "maturin>=1.7,<2" pytest
    rm -rf target/wheels
    "$venv/bin/maturin" build --profile dev --features mantissa/mpi -m python/Cargo.toml -o target/wheels 2>&1 | tail -n 2
    "$venv/bin/pip" install -q --disable-pip-version-check target/wheels/mantissa-*.whl
    root=$PWD
    (cd "$venv" && XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}" bin/python -m pytest -q -p no:cacheprovider "$root/python/tests") 2>&1 | tee -a "$log"
    echo "python package: passed" >> "$log"
else
    echo "SKIPPED python package: no python3" | tee -a "$log"
fi
if [ -n "$web_pid" ]; then
    web_status=0
    wait "$web_pid" || web_status=$?
    web_pid=
    tee -a "$log" < "$web_log"
    [ "$web_status" -eq 0 ] || { echo "browser test failed (exit $web_status)"; exit "$web_status"; }
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
     /^[0-9]+ passed.* in [0-9.]+s/ { py = "python: " $1 " passed" } /^python package: passed/ { pyok = 1 }
     /^SKIPPED python/ { py = "python: skipped" }
     /^cuda: absent/ { cuda = "cuda: skipped (absent)" } /^cuda: [^a]/ { cuda = "cuda: ran" }
     /^SKIPPED / && !/^SKIPPED (browser|cooperative|python)/ { s++ }
     END { printf "tests: %d passed, %d failed, %d skipped%s; %s; %s; %s; %s\n", p - s, f, s, fuzz, py, coop, web, cuda }' "$log"
