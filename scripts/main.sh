#!/usr/bin/env bash
# The main job: what this machine offers, then a matmul precision table on the best device.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
cargo build --release --quiet
./target/release/mantissa info
echo
./target/release/mantissa bench matmul --sizes 256 --algorithms all --reps 3 "$@"
