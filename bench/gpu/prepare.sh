#!/bin/bash
# Run on the development machine, in the project's root (`bash bench/gpu/prepare.sh`), after
# `.venv/bin/mlx-server-demo` has imported the demo model (its tokenizer is reused).
# Builds .gpu/a (< 64 MiB: wheels, tokenizer, these scripts, first half of the mlx-cuda wheel),
# .gpu/b (second half) and .gpu/v (mlx-vlm's wheels, for vision.sh), all git-ignored, for the runs on the
# GPU machine (docs/benchmarks.md, "GPU").
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
TOK=${TOK:-models/smollm2-135m-instruct}
[ -f "$TOK/tokenizer.json" ] || { echo "no tokenizer at $TOK (run .venv/bin/mlx-server-demo first)"; exit 1; }
# In a linked worktree .git is a file: ask git where the (shared) exclude file lives.
EXCLUDE=$(git rev-parse --git-path info/exclude)
grep -qx '/.gpu/' "$EXCLUDE" 2>/dev/null || echo '/.gpu/' >> "$EXCLUDE"
MLX=${MLX_VERSION:-$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("mlx"))')}
MLXLM=${MLXLM_VERSION:-$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("mlx-lm"))')}
# Runtime dependencies the device image lacks (it has numpy, transformers, tokenizers, jinja2,
# httpx, huggingface_hub, tqdm, pyyaml, safetensors, anyio, h11, click). Add new ones here.
# PYSPY=1 adds py-spy (device_bench.sh's PROFILE burst samples the server's threads with it), in .gpu/b: .gpu/a
# and the checkout fit one run's 64 MiB with little room.
WHEELS=${WHEELS:-"fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions
  annotated-doc opentelemetry-api uvicorn httptools llguidance jsonschema jsonschema-specifications referencing rpds-py gguf"}
[ "${PYSPY:-0}" = 1 ] && WHEELS="$WHEELS py-spy"
rm -rf .gpu && mkdir -p .gpu/a/wheels .gpu/b .gpu/dl
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform any"
for n in 5 17 24 27 28 31 34 35; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
python3 -m pip download -q --no-deps $PLAT -d .gpu/dl "mlx==$MLX" "mlx-cuda-13==$MLX" "mlx-lm==$MLXLM" $WHEELS 2>&1 | grep -v "is ignored" || true
mv .gpu/dl/mlx_cuda_13-*.whl .gpu/
# py-spy goes with the second run (.gpu/a and the checkout must fit one run's 64 MiB)
mkdir -p .gpu/b/wheels && { mv .gpu/dl/py_spy-*.whl .gpu/b/wheels/ 2>/dev/null || true; }
mv .gpu/dl/*.whl .gpu/a/wheels/
# The mlx-cuda wheel (~90 MB) is over one run's 64 MiB: split it across the two runs.
split -b 45000000 -d .gpu/mlx_cuda_13-*.whl .gpu/a/mlx_cuda.part.
mv .gpu/a/mlx_cuda.part.01 .gpu/b/ && basename .gpu/mlx_cuda_13-*.whl > .gpu/a/mlx_cuda.name && rm .gpu/mlx_cuda_13-*.whl
mkdir -p .gpu/a/tok && cp "$TOK"/tokenizer* .gpu/a/tok/
cp "$HERE"/*.py "$HERE"/*.sh .gpu/a/
# The server's source travels too: the device receives the session's checkout, which need not be
# the tree being measured (a linked worktree's branch, say). device_bench.sh runs this copy.
SRC_TREE=$(cd "$HERE/../.." && pwd)/src
mkdir -p .gpu/a/src && cp -r "$SRC_TREE"/mlx_server .gpu/a/src/ && find .gpu/a/src -name __pycache__ -prune -exec rm -rf {} +
rmdir .gpu/dl
# .gpu/v: mlx-vlm and what it imports that the device image lacks (it has transformers >= 5.14,
# Pillow, scipy, sentencepiece, opencv, torch), for vision.sh: mlx_vlm.server, and this server's
# vision path. Pure-Python wheels but cryptography (abi3), orjson (cp312).
MLXVLM=${MLXVLM_VERSION:-$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("mlx-vlm"))')}
MLXAUDIO=${MLXAUDIO_VERSION:-$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("mlx-audio"))')}
VWHEELS=${VWHEELS:-"cryptography cffi pycparser truststore python-multipart dill orjson websockets"}
mkdir -p .gpu/v
python3 -m pip download -q --no-deps $PLAT -d .gpu/v "mlx-vlm==$MLXVLM" "mlx-audio==$MLXAUDIO" $VWHEELS 2>&1 | grep -v "is ignored" || true
du -sh .gpu/a .gpu/b .gpu/v
echo "next, on the GPU machine: 'bash .gpu/a/lay.sh' with .gpu/a along; right after: 'bash /tmp/kit/a/device_bench.sh' with .gpu/b along"
echo "vision (bench/gpu/vision.sh): 'bash .gpu/a/lay.sh' (.gpu/a); 'bash bench/gpu/install.sh' (.gpu/b); 'bash /tmp/kit/a/vision.sh' (.gpu/v)"
