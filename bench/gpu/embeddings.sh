#!/bin/bash
# The embeddings benchmark on the GPU machine: bench/embeddings.py, ours (MLX on the GPU) against sentence-transformers
# (torch on CUDA), 1, 16 and 256 short texts and 32 long ones, once per weights dtype; JSON lines appended to
# $OUT/results.jsonl (scenario "embeddings", as bench/results/h200.jsonl holds the kit's other lines), the table to
# $OUT/embeddings.txt. Run from the project's root with .gpu/e along (bash bench/gpu/prepare_embeddings.sh made it),
# on a machine whose /tmp/site has MLX for CUDA: after `bash .gpu/a/lay.sh` (.gpu/a along), then either
# device_bench.sh or `bash bench/gpu/install.sh` (.gpu/b along) in earlier runs; with .gpu/b along as well, this
# script runs install.sh itself. The wheels in .gpu/e that the machine lacks (site_wheels.py) are installed offline.
# Env: E=.gpu/e (the carried folder), S=/tmp/site, DTYPES="float16 float32", REPEATS=5, TORCH_DEVICE=cuda,
#      WORKLOADS="1 short,16 short,256 short,32 long", LABEL=h200, PYTHON=python3, SRC=$PWD/src,
#      BENCH_TIMEOUT=280 (seconds per dtype: two fit in one 10-minute run).
set -u
E=${E:-.gpu/e}; S=${S:-/tmp/site}; OUT=${OUT:-/tmp/out}; PYTHON=${PYTHON:-python3}; SRC=${SRC:-$PWD/src}
DTYPES=${DTYPES:-"float16 float32"}; REPEATS=${REPEATS:-5}; TORCH_DEVICE=${TORCH_DEVICE:-cuda}
WORKLOADS=${WORKLOADS:-"1 short,16 short,256 short,32 long"}; LABEL=${LABEL:-h200}; BENCH_TIMEOUT=${BENCH_TIMEOUT:-280}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT" "$S"; R=$OUT/results.jsonl
exec > >(tee -a "$OUT/embeddings.txt") 2>&1
[ -f "$E/model/config.json" ] || { echo "no model in $E/model: run bench/gpu/prepare_embeddings.sh here, carry $E"; exit 1; }
export PYTHONPATH=$S:$SRC PYTHONUNBUFFERED=1
if ! "$PYTHON" -c 'import mlx.core' 2> /dev/null; then
  bash "$HERE/install.sh" || { echo "no MLX: run 'bash bench/gpu/install.sh' with .gpu/b along first"; exit 1; }
fi
NEED=$("$PYTHON" "$HERE/site_wheels.py" "$E/wheels" --site "$S") || exit 1
if [ -n "$NEED" ]; then
  echo "installing into $S: $(echo $NEED | xargs -n1 basename | tr '\n' ' ')"
  # shellcheck disable=SC2086
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$S" $NEED || exit 1
fi
"$PYTHON" -c 'import mlx.core as mx, torch; print("mlx", mx.__version__, mx.default_device(), "| torch", torch.__version__, "cuda:", torch.cuda.is_available())'
status=0
for dtype in $DTYPES; do
  echo "== $dtype"
  timeout "$BENCH_TIMEOUT" "$PYTHON" bench/embeddings.py --model "$E/model" --repeats "$REPEATS" --torch-device "$TORCH_DEVICE" \
    --dtype "$dtype" --workloads "$WORKLOADS" --json "$R" --label "$LABEL $dtype" || status=1
done
exit $status
