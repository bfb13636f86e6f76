#!/usr/bin/env bash
# One kernel variant, measured and checked in one call, one line per shape: for iterating on a
# kernel on a machine with a GPU, with a release binary built beforehand (no rebuild there).
#
#   cp -r shaders cuda k/        # then edit k/shaders/matmul_coop.wgsl (or any kernel file)
#   bash scripts/kernel-variant.sh --kernels k --algorithms f16,bf16x3 --sizes 4096,384x1152x16384
#
# Options (all optional):
#   --kernels DIR        MANTISSA_KERNEL_DIR for the variant (docs/wgpu.md, "Kernel iteration")
#   --candidates FILE    MANTISSA_TUNE_CANDIDATES: the tiles (wgpu) or split paths (cuda) tried
#   --backend B          wgpu (default) or cuda
#   --algorithms LIST    default f32,f16,bf16x3
#   --sizes LIST         default 4096,384x1152x16384 (N or MxNxK; the second is a weight gradient)
#   --reps N             timed repetitions per shape (default 10)
#   --bin PATH           the binary (default target/release/mantissa)
#   --no-baseline        skip the built-in kernels' run (by default they run first, in the same
#                        call, so each line gives the variant's ratio to them)
#
# Each line: shape, algorithm, the variant that ran (tile, autotuned or not), TFLOP/s, the ratio
# to the built-in kernels, the relative error on the benchmark's error rows against its expected
# band, and the contract check of those rows. Then the portability report's gate on small and
# odd sizes over every input family (NaN, inf, subnormals, overflow), the variant's kernels
# against the host reference: "gate: PASSED" or the breaks. A replaced kernel that fails to
# validate, compile, or its first check against the host reference is refused by the binary
# (said on stderr) and the built-in one runs: the line's variant and ratio then show it.
set -uo pipefail
cd "$(dirname "$0")/.."
kernels="" candidates="" backend=wgpu algorithms=f32,f16,bf16x3
sizes=4096,384x1152x16384 reps=10 bin=target/release/mantissa baseline=1
while [ $# -gt 0 ]; do
    case "$1" in
    --kernels) kernels=$2; shift 2 ;;
    --candidates) candidates=$2; shift 2 ;;
    --backend) backend=$2; shift 2 ;;
    --algorithms) algorithms=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --no-baseline) baseline=0; shift ;;
    *) echo "kernel-variant: unknown option $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
[ -x "$bin" ] || { echo "kernel-variant: no binary at $bin (cargo build --release, or --bin)" >&2; exit 2; }
if command -v nvidia-smi >/dev/null 2>&1; then
    source scripts/gpu-env.sh
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# bench NAME ENV...: the benchmark with the environment given, its JSON in $tmp/NAME.json.
bench() {
    local name=$1; shift
    env "$@" MANTISSA_CACHE_DIR="$tmp/cache-$name" "$bin" bench matmul --backends "$backend" \
        --algorithms "$algorithms" --sizes "$sizes" --reps "$reps" --json "$tmp/$name.json" \
        >"$tmp/$name.log" 2>&1
    local rc=$?
    grep "^warning\|^mantissa:" "$tmp/$name.log" | sed "s/^/[$name] /" >&2
    return $rc
}
variant_env=()
[ -n "$kernels" ] && variant_env+=(MANTISSA_KERNEL_DIR="$kernels")
[ -n "$candidates" ] && variant_env+=(MANTISSA_TUNE_CANDIDATES="$candidates")
if [ "$baseline" = 1 ]; then
    bench builtin MANTISSA_KERNEL_DIR= MANTISSA_TUNE_CANDIDATES= || echo "kernel-variant: the built-in run failed (exit $?)" >&2
fi
bench variant "${variant_env[@]}" || { echo "kernel-variant: the variant's benchmark failed (exit $?):" >&2; tail -n 5 "$tmp/variant.log" >&2; }
if grep -q "refused" "$tmp/variant.log"; then
    echo "NOTE: kernels of the variant were refused (above): where they were, the built-in ones ran"
fi
python3 - "$tmp" <<'EOF'
import json, os, sys
tmp = sys.argv[1]
def load(name):
    path = os.path.join(tmp, name + ".json")
    return json.load(open(path)) if os.path.exists(path) else []
base = {(r["algorithm"], r["m"], r["n"], r["k"]): r for r in load("builtin")}
rows = load("variant")
if not rows:
    sys.exit("kernel-variant: no benchmark records")
for r in rows:
    key = (r["algorithm"], r["m"], r["n"], r["k"])
    b = base.get(key)
    ratio = f"{r['tflops'] / b['tflops']:.2f}x built-in" if b and b["tflops"] else "-"
    lo, hi = r.get("expected_error") or (0.0, float("inf"))
    err = r.get("relative_error")
    band = "in band" if err is not None and err <= hi else "OUT OF BAND"
    breaks = r.get("contract_breaks")
    contract = "contract ok" if not breaks else f"CONTRACT BROKEN ({breaks})"
    shape = f"{r['m']}x{r['n']}x{r['k']}"
    print(f"{shape:<16} {r['algorithm']:<8} {r['tflops']:8.2f} TFLOP/s  {ratio:<16} "
          f"err {err:.2e} ({band} {lo:g}..{hi:g})  {contract}  [{r['variant']}]")
EOF
# The gate: small and odd sizes, every input family, against the host reference.
env "${variant_env[@]}" MANTISSA_CACHE_DIR="$tmp/cache-variant" "$bin" report --backends "reference,$backend" \
    --algorithms "$algorithms" --sizes 64,131x67x200,37x45x1101 --train-steps 0 --out "$tmp/report" \
    >"$tmp/report.log" 2>&1
case $? in
0) echo "gate: PASSED (report over every input family at 64, 131x67x200, 37x45x1101)" ;;
3) echo "gate: CONTRACT BROKEN"; grep -i "break\|fail" "$tmp/report.log" | head -n 20 ;;
*) echo "gate: did not run"; tail -n 5 "$tmp/report.log" ;;
esac
