#!/usr/bin/env bash
# Set up, fetch the demo model once, lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/mlx-server-demo
.venv/bin/mlx-server-demo --dtype float32
.venv/bin/mlx-server-demo --embedding
# shellcheck source=/dev/null
source scripts/openblas.sh
bash scripts/check.sh
.venv/bin/python -m pytest -q --durations=30 "$@"
