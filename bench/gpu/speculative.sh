#!/bin/bash
# Speculative decoding on the GPU machine: bench/speculative.py (with and without speculation in one run, ratios
# printed) on the demo model dequantized to float16 and on random-weight models of real sizes (no acceptance
# possible: the cost of trying). Run from the project's root on a machine whose /tmp/site has MLX for CUDA (after
# `bash .gpu/a/lay.sh` and `bash bench/gpu/install.sh`, .gpu/b along) and whose /tmp/kit/demo holds the demo model's
# parts (bench/gpu/park_demo.sh in each run that carries one). JSON lines to $OUT/results.jsonl, the log to
# $OUT/speculative.txt.
# Env: MODELS="demo 1b:0 8b:4" (demo: the parked demo model; preset:bits: a random-weight model made here; a
#      folder: that model), TOKENS=200, KS=2,4,8 (draft lengths; the first is the batch's), REPEAT=2,
#      STREAMS=8, PER_MODEL_S=240, PARK=/tmp/kit/demo, MODELS_DIR=/tmp/models, DTYPE=float16 (the demo model's), PYTHON=python3, S=/tmp/site, K=/tmp/kit/a, SRC=$PWD/src.
set -u
PYTHON=${PYTHON:-python3}; S=${S:-/tmp/site}; K=${K:-/tmp/kit/a}; OUT=${OUT:-/tmp/out}; SRC=${SRC:-$PWD/src}
MODELS=${MODELS:-"demo 1b:0 8b:4"}; TOKENS=${TOKENS:-200}; KS=${KS:-2,4,8}; REPEAT=${REPEAT:-2}; STREAMS=${STREAMS:-8}
PARK=${PARK:-/tmp/kit/demo}; MODELS_DIR=${MODELS_DIR:-/tmp/models}
PER_MODEL_S=${PER_MODEL_S:-240}; DTYPE=${DTYPE:-float16}; HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"; R=$OUT/results.jsonl
exec > >(tee -a "$OUT/speculative.txt") 2>&1
export PYTHONPATH=$S:$SRC PYTHONUNBUFFERED=1
"$PYTHON" -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())' || exit 1
status=0
for spec in $MODELS; do
  if [ -d "$spec" ]; then
    M=$spec; label=$(basename "$spec"); extra=""
  elif [ "$spec" = demo ]; then
    M=$MODELS_DIR/demo; label="demo $DTYPE"; extra="--dtype $DTYPE"
    if [ ! -f $M/model.safetensors ]; then
      D=$PARK; [ -f $D/config.json ] || { echo "no demo model parts in $D"; status=1; continue; }
      mkdir -p $M && cp $D/*.json $M/ && cat $D/d.part.* > $M/model.safetensors
      (cd $M && sha256sum -c $D/model.sha256) || { status=1; continue; }
    fi
  else
    preset=${spec%%:*}; bits=${spec##*:}; M=$MODELS_DIR/$preset-$bits; label="random $preset-$bits"; extra=""
    [ -f $M/config.json ] || "$PYTHON" "$HERE/make_random_model.py" $M $preset $bits $K/tok || { status=1; continue; }
  fi
  echo "== $label $(date +%T)"
  # shellcheck disable=SC2086
  timeout "$PER_MODEL_S" "$PYTHON" bench/speculative.py --model $M $extra --tokens "$TOKENS" --num-draft-tokens "$KS" \
    --repeat "$REPEAT" --streams "$STREAMS" --json "$R" --label "$label" || status=1
done
exit $status
