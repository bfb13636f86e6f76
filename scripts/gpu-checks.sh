#!/usr/bin/env bash
# The GPU checks owed by sessions without a GPU, in one call on the lent GPU machine (the
# `device` tool runs commands in a copy of this repo there; see ../shared/FACTS.md).
#
# Prepare here, once per session (all under folders that .git/info/exclude ignores):
#   echo /.gl/ >> .git/info/exclude; echo /.anchors/ >> .git/info/exclude
#   mkdir -p .gl /tmp/amd64/partial .anchors && cp ../shared/anchors/*.py .anchors/
#   o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
#   apt-get $o update && (cd .gl && apt-get $o download libvulkan1)
#   cargo build --release
#   cargo test --release --test conformance --test train --no-run   # then: mkdir -p .bin and
#     copy the target/release/deps/conformance-* and train-* executables it names to
#     .bin/conformance and .bin/train
# Then run with carry [".gl", ".anchors", ".bin", "target/release/mantissa"]:
#   bash scripts/gpu-checks.sh
# Everything lands in $OUT (or ./gpu-checks when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-checks}"
mkdir -p "$out"
for f in .gl/*.deb; do [ -e "$f" ] && dpkg -x "$f" /; done
ldconfig
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
if [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
# CUDA from PyTorch's pip wheels (cuBLAS, NVRTC): put their lib directories on the path.
nv_libs=$(python3 -c 'import glob, os, nvidia; print(":".join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + "/*/lib/*.so*")})))' 2>/dev/null)
[ -n "$nv_libs" ] && export LD_LIBRARY_PATH="$nv_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
m=./target/release/mantissa
run() { echo "== $*"; "$@" 2>&1 | tee -a "$out/log.txt"; }
run nvidia-smi
run $m info
# The conformance suite on the CUDA backend (and wgpu on the GPU).
if [ -x .bin/conformance ]; then
    run .bin/conformance cuda:: --test-threads 1
    run .bin/conformance wgpu:: --test-threads 1
fi
# The resident step plans against the host interpreter, and learning, on CUDA and wgpu.
if [ -x .bin/train ]; then
    run .bin/train resident loss_falls --test-threads 1
fi
run $m bench matmul --sizes 4096,8192 --algorithms all --backends cuda --reps 10 --json "$out/bench-cuda.json"
run $m bench matmul --sizes 4096,8192 --algorithms all --backends wgpu --reps 10 --json "$out/bench-unchecked.json"
MANTISSA_WGSL_CHECKS=on run $m bench matmul --sizes 4096 --algorithms f32,bf16x3 --backends wgpu --reps 5 --json "$out/bench-checked.json"
run $m bench matmul --sizes 8192x1x8192 --algorithms f32,e4m3 --backends wgpu --reps 10 --json "$out/bench-matvec.json"
# Cooperative matrices (16x16x16 on NVIDIA) against the SIMT kernels, and every tile tuned.
MANTISSA_COOP=off run $m bench matmul --sizes 4096 --algorithms f16,bf16,bf16x3,bf16x6 --backends wgpu --reps 5 --json "$out/bench-simt.json"
MANTISSA_AUTOTUNE=full run $m bench matmul --sizes 4096,8192 --algorithms f32,f16,bf16x3 --backends wgpu --reps 5 --json "$out/bench-tuned.json"
if [ -d .anchors ]; then
    run python3 .anchors/torch_matmul.py
fi
run $m report --backends all --sizes 256,1000x700x1500 --train-steps 100 --out "$out/report"
run $m train --config small --precision 32-true,16-mixed,bf16-mixed,16-true,bf16-true --steps 300 --eval-interval 50 --backend wgpu --out "$out/train"
run $m train --config small --precision 32-true,16-mixed,bf16-mixed,16-true,bf16-true --steps 300 --eval-interval 50 --backend cuda --out "$out/train-cuda"
if [ -d .anchors ]; then
    run python3 .anchors/torch_gpt.py
fi
