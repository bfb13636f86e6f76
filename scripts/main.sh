#!/usr/bin/env bash
# The main job: what this machine offers, then a short training run of the char-level GPT on
# the best device found, under three presets (fp32, mixed bf16, pure fp16).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
# With MPI, so that `mpirun -np N ./target/release/mantissa train ...` runs data parallel.
cargo build --release --quiet --features mpi
./target/release/mantissa info
echo
./target/release/mantissa train --config tiny --precision 32-true,bf16-mixed,16-true --steps 100 --eval-interval 25 --out runs "$@"
