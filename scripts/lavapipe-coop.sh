#!/usr/bin/env bash
# Runs a command against lavapipe from Mesa 26, which offers cooperative matrices (8x8x8 f16 ->
# f32, emulated on the CPU), so the cooperative-matrix kernels run and are checked on any
# machine. Debian 12's Mesa 22 has no cooperative matrices; Mesa 26 is in trixie-backports and
# needs trixie's C library, so this fetches those packages into target/lavapipe-coop (once) and
# runs the command's binaries through trixie's dynamic loader, without touching the system.
#
#   bash scripts/lavapipe-coop.sh cargo test --test conformance --test coop
#   bash scripts/lavapipe-coop.sh run target/release/mantissa info
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD/target/lavapipe-coop"
sys="$root/root"
mirror=http://deb.debian.org/debian
packages="mesa-vulkan-drivers libvulkan1 libc6 libgcc-s1 libstdc++6 zlib1g libzstd1 libxshmfence1
  libxcb1 libxdmcp6 libxau6 libxcb-xfixes0 libxcb-sync1 libxcb-shm0 libxcb-randr0 libxcb-present0
  libxcb-dri3-0 libx11-xcb1 libx11-6 libwayland-client0 libffi8 libpng16-16t64 libllvm19 libz3-4
  libxml2 liblzma5 libedit2 libtinfo6 libbsd0 libmd0 libexpat1 libelf1t64 libdrm2 libdrm-amdgpu1
  libdisplay-info2"

if [ ! -f "$root/ready" ]; then
  echo "lavapipe-coop: fetching Mesa 26 lavapipe and its trixie runtime into $root"
  if ! command -v curl >/dev/null || ! command -v xz >/dev/null; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq curl xz-utils >/dev/null
  fi
  rm -rf "$root" && mkdir -p "$root/debs" "$sys"
  # trixie-backports last, so its newer packages (Mesa 26) win.
  for suite in trixie trixie-backports; do
    curl -fsSL "$mirror/dists/$suite/main/binary-amd64/Packages.xz" | xz -d \
      | awk '/^Package: /{p=$2} /^Filename: /{print p, $2}' >> "$root/index"
  done
  for p in $packages; do
    file=$(awk -v p="$p" '$1 == p {f=$2} END {print f}' "$root/index")
    [ -n "$file" ] || { echo "lavapipe-coop: package $p not found" >&2; exit 1; }
    curl -fsSL -o "$root/debs/${file##*/}" "$mirror/$file"
    dpkg-deb -x "$root/debs/${file##*/}" "$sys"
  done
  sed "s#\"libvulkan_lvp.so\"#\"$sys/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so\"#" \
    "$sys/usr/share/vulkan/icd.d/lvp_icd.json" > "$root/lvp_icd.json"
  rm -rf "$root/debs"
  touch "$root/ready"
fi

loader="$sys/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 --library-path $sys/usr/lib/x86_64-linux-gnu"
export VK_ICD_FILENAMES="$root/lvp_icd.json"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
if [ "${1:-}" = run ]; then
  shift
  exec $loader "$@"
fi
# cargo builds with the system toolchain and runs test binaries through trixie's loader.
export CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$loader"
exec "$@"
