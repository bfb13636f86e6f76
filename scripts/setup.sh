#!/usr/bin/env bash
# Makes sure wgpu can find a GPU: when no Vulkan driver is installed, installs Mesa's lavapipe
# (a software Vulkan GPU) so that everything also runs on a machine without a GPU.
# Sourced (scripts/main.sh, scripts/test.sh, or a developer's shell): the strict options hold
# inside this function alone (`local -`), while its exports reach the caller.
mantissa_setup() {
    local -
    set -euo pipefail
    # A driver file in either directory (one of them may not exist), and the loader.
    have_vulkan_driver() {
        local f
        for f in /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json; do
            [ -e "$f" ] && ldconfig -p | grep libvulkan.so.1 >/dev/null && return 0
        done
        return 1
    }
    if ! have_vulkan_driver; then
        echo "setup: no Vulkan driver found; installing lavapipe (mesa-vulkan-drivers, libvulkan1)" >&2
        SUDO=""
        [ "$(id -u)" -eq 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null
    fi
    # The Vulkan loader's window-system probes complain when this is unset; compute needs none.
    export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
    # NVRTC, so that the tests compile the CUDA kernels even without a GPU.
    source "$(dirname "${BASH_SOURCE[0]}")/nvrtc.sh"
    # A C++ compiler, for the test that runs the CUDA elementwise kernels on the host.
    if ! command -v c++ >/dev/null; then
        SUDO=""
        [ "$(id -u)" -eq 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq g++ >/dev/null
    fi
    # Open MPI, for data-parallel training (`mpirun -np N mantissa train`; the cargo feature `mpi`),
    # and libclang with its headers, which rsmpi's build uses to generate its bindings.
    if ! command -v mpicc >/dev/null || ! ls /usr/lib/llvm-*/lib/clang/*/include/stddef.h >/dev/null 2>&1; then
        echo "setup: installing Open MPI and libclang (data-parallel training)" >&2
        SUDO=""
        [ "$(id -u)" -eq 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenmpi-dev openmpi-bin libclang-dev >/dev/null
    fi
    # mpirun refuses to run as root unless told to (CI containers run as root).
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
}
mantissa_setup
