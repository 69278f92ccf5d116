#!/usr/bin/env bash
# Install the project with its test tools, vision and embeddings support (torch included, as
# the embedding tests' reference), fetch the demo models once, lint, and run the whole test
# suite. Idempotent. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,vision,embeddings
.venv/bin/mlx-server-demo
.venv/bin/mlx-server-demo --dtype float32
.venv/bin/mlx-server-demo --embedding
# shellcheck source=/dev/null
source scripts/openblas.sh
bash scripts/check.sh
# Two workers, each running whole test files (module fixtures stay shared within a file).
.venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=30 "$@"
