#!/usr/bin/env bash
# Sourced by the scripts that run on a machine with an NVIDIA GPU (scripts/gpu-checks.sh,
# scripts/kernel-variant.sh), from the repository root: Vulkan and CUDA made reachable there.
# - Debian's libvulkan1 .deb brought in .gl/ (the machine has the NVIDIA ICD but no loader),
#   unpacked.
# - The driver's own ICD file names libGLX_nvidia, which finds no display in a headless
#   container and returns no vkCreateInstance; the EGL library is the headless entry to the same
#   driver.
# - CUDA from PyTorch's pip wheels (cuBLAS, NVRTC, NCCL): their lib directories on the path.
for f in .gl/*.deb; do [ -e "$f" ] && dpkg -x "$f" /; done
ldconfig
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
printf '{"file_format_version":"1.0.1","ICD":{"library_path":"libEGL_nvidia.so.0","api_version":"1.3.0"}}' >/tmp/nvidia_headless_icd.json
export VK_DRIVER_FILES=/tmp/nvidia_headless_icd.json
nv_libs=$(python3 -c 'import glob, os, nvidia; print(":".join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + "/*/lib/*.so*") + glob.glob(d + "/*/*/lib/*.so*")})))' 2>/dev/null)
[ -n "$nv_libs" ] && export LD_LIBRARY_PATH="$nv_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
