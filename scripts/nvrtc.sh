#!/usr/bin/env bash
# Sourced by scripts/setup.sh: makes NVRTC loadable so that the test suite compiles every CUDA
# kernel (tests/cuda.rs). NVRTC is a compiler library and needs no GPU. Where none is installed,
# fetches NVIDIA's pip wheel (x86_64 Linux) into .cache/nvrtc and puts it on LD_LIBRARY_PATH.
nvrtc_dir="$PWD/.cache/nvrtc"
nvrtc_version="13.0.88"  # CUDA 13.0, the driver generation of the GPU machines we test on
if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so' && [ "$(uname -sm)" = "Linux x86_64" ]; then
    if [ ! -e "$nvrtc_dir/lib/libnvrtc.so.13" ]; then
        echo "setup: fetching NVRTC $nvrtc_version (pip wheel) into .cache/nvrtc" >&2
        if ! python3 -m pip --version >/dev/null 2>&1; then
            SUDO=""
            [ "$(id -u)" -eq 0 ] || SUDO="sudo"
            $SUDO apt-get update -qq
            DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-pip >/dev/null
        fi
        tmp=$(mktemp -d)
        if python3 -m pip download -q --no-deps "nvidia-cuda-nvrtc==$nvrtc_version" -d "$tmp" >&2; then
            mkdir -p "$nvrtc_dir/lib"
            python3 -c 'import sys, zipfile
w = zipfile.ZipFile(sys.argv[1])
for n in w.namelist():
    if "/lib/" in n and ".so" in n:
        open(sys.argv[2] + "/" + n.rsplit("/", 1)[1], "wb").write(w.read(n))' "$tmp"/*.whl "$nvrtc_dir/lib"
        else
            echo "setup: could not fetch NVRTC; the CUDA kernel compile test will say it is skipped" >&2
        fi
        rm -rf "$tmp"
    fi
    if [ -e "$nvrtc_dir/lib/libnvrtc.so.13" ]; then
        export LD_LIBRARY_PATH="$nvrtc_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
fi
