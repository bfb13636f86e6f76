#!/usr/bin/env bash
# The test suite: unit tests, shader validation (naga, every kernel variant), the conformance
# suite on every backend present (lavapipe where there is no GPU), and the CLI.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
cargo test --all-targets "$@"
