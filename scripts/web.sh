#!/usr/bin/env bash
# The browser demo.
#   bash scripts/web.sh serve [PORT]   build it and serve it on http://localhost:PORT (8080)
#   bash scripts/web.sh build          build it into target/web/
#   bash scripts/web.sh test           build it and run the headless-Chromium test (web/test_page.py)
#   bash scripts/web.sh prepare        install what `test` needs and build (`test` then only checks)
# Installs what it needs when missing: the wasm32 target, wasm-bindgen-cli at the version in
# Cargo.lock, and for `test` Debian's chromium, chromium-driver and python3-selenium.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-serve}"
out=target/web

install_packages() {
    local missing=()
    for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    [ ${#missing[@]} -eq 0 ] && return
    echo "web: installing ${missing[*]}" >&2
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
}

build() {
    rustup target list --installed | grep -q wasm32-unknown-unknown ||
        rustup target add wasm32-unknown-unknown
    # wasm-bindgen's CLI must match the library version exactly.
    local version
    version=$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/"/, "", $3); print $3 }' Cargo.lock)
    if ! wasm-bindgen --version 2>/dev/null | grep -q " $version\$"; then
        echo "web: installing wasm-bindgen-cli $version" >&2
        cargo install -q --force wasm-bindgen-cli --version "$version"
    fi
    cargo build -q -p mantissa-web --target wasm32-unknown-unknown --release
    rm -rf "$out"
    mkdir -p "$out"
    wasm-bindgen --target web --no-typescript --out-dir "$out/pkg" \
        target/wasm32-unknown-unknown/release/mantissa_web.wasm
    cp web/www/* "$out/"
    cp data/shakespeare.txt "$out/"
    echo "web: built $out ($(du -sh "$out/pkg" | cut -f1) of wasm and glue)" >&2
}

case "$what" in
    build) build ;;
    serve)
        build
        port="${2:-8080}"
        echo "web: open http://localhost:$port/ in a browser with WebGPU (Ctrl-C stops)" >&2
        exec python3 -m http.server "$port" --bind 127.0.0.1 --directory "$out"
        ;;
    prepare)
        install_packages chromium chromium-driver python3-selenium
        build
        ;;
    test)
        install_packages chromium chromium-driver python3-selenium
        build
        # Debian's python3 has selenium; a pyenv or venv python on PATH may not.
        exec /usr/bin/python3 web/test_page.py --site "$out" "${@:2}"
        ;;
    *)
        echo "usage: bash scripts/web.sh serve [PORT] | build | prepare | test" >&2
        exit 2
        ;;
esac
