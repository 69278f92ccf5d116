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
.venv/bin/python -m pytest -q --durations=30 "$@"
