#!/usr/bin/env bash
# Runs a command against lavapipe from Mesa 26, which offers cooperative matrices (8x8x8 f16 ->
# f32, emulated on the CPU), so the cooperative-matrix kernels run and are checked on any
# machine. Debian 12's Mesa 22 has no cooperative matrices; Mesa 26 is in trixie-backports and
# needs trixie's C library, so this fetches those packages into target/lavapipe-coop (once) and
# runs the command's binaries through trixie's dynamic loader, without touching the system.
# The packages come through apt from the Debian mirror the machine's own apt sources name, with
# trixie and trixie-backports as extra suites in a private apt state (the system's is untouched).
#
#   bash scripts/lavapipe-coop.sh cargo test --test conformance --test coop
#   bash scripts/lavapipe-coop.sh run target/release/mantissa info
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD/target/lavapipe-coop"
sys="$root/root"
packages="mesa-vulkan-drivers libvulkan1 libc6 libgcc-s1 libstdc++6 zlib1g libzstd1 libxshmfence1
  libxcb1 libxdmcp6 libxau6 libxcb-xfixes0 libxcb-sync1 libxcb-shm0 libxcb-randr0 libxcb-present0
  libxcb-dri3-0 libx11-xcb1 libx11-6 libwayland-client0 libffi8 libpng16-16t64 libllvm19 libz3-4
  libxml2 liblzma5 libedit2 libtinfo6 libbsd0 libmd0 libexpat1 libelf1t64 libdrm2 libdrm-amdgpu1
  libdisplay-info2"

if [ ! -f "$root/ready" ]; then
  echo "lavapipe-coop: fetching Mesa 26 lavapipe and its trixie runtime into $root"
  # The machine's Debian mirror: the first URI its apt sources give for a Debian suite that is
  # not the security archive (deb822 .sources files, then the one-line format).
  mirror=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ && !/security/ {print $2; exit}')
  [ -n "$mirror" ] || mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
    | awk '$1 == "deb" && !/security/ {for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) {print $i; exit}}')
  [ -n "$mirror" ] || { echo "lavapipe-coop: no Debian mirror in the apt sources" >&2; exit 1; }
  rm -rf "$root" && mkdir -p "$root/debs" "$root/apt/lists/partial" "$root/apt/cache/archives/partial" "$sys"
  mkdir -p "$root/apt/sources.d"
  printf 'Types: deb\nURIs: %s\nSuites: trixie trixie-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$mirror" > "$root/apt/sources.d/trixie.sources"
  apt=(-o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$root/apt/sources.d"
       -o Dir::State::Lists="$root/apt/lists" -o Dir::Cache="$root/apt/cache"
       -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts="$root/apt/sources.d"
       -o APT::Architecture=amd64 -o APT::Architectures=amd64 -o APT::Sandbox::User=root)
  # trixie-backports wins where it has the package (Mesa 26; pinned by its codename, as its
  # suite is stable-backports, above trixie's 500), trixie otherwise: one download for every
  # package (each apt-get run reads both suites' indexes anew, seconds apiece).
  printf 'Package: *\nPin: release n=trixie-backports\nPin-Priority: 600\n' > "$root/apt/sources.d/backports.pref"
  apt-get "${apt[@]}" -qq update
  cd "$root/debs"
  # shellcheck disable=SC2086 # one word a package
  apt-get "${apt[@]}" -qq download $packages || { echo "lavapipe-coop: a package was not found" >&2; exit 1; }
  for deb in *.deb; do dpkg-deb -x "$deb" "$sys"; done
  cd - >/dev/null
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
