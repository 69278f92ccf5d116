#!/bin/bash
# Linear attention on the GPU machine: the CUDA gated-delta kernel against mlx-lm's step-by-step path
# (gated_delta.py: differences and times at Qwen3.5-9B's shapes), then new-offset costs of decode and verify passes
# (verify_shapes.py) and, with LONG>0, one long prompt's prefill, per model. Run from the project's root, after
# `bash .gpu/a/lay.sh` (.gpu/a along, made here by `bash bench/gpu/prepare.sh`), in the next call with .gpu/b along
# (or on a machine where /tmp/site already has MLX for CUDA). Results: $OUT/results.jsonl (scenarios "gated_delta",
# "verify_shapes"), the log $OUT/linear_attention.txt.
# Env: MODELS="qwen35-9b:4" (preset:bits, random weights built in $MODELS_DIR; a folder: that model; empty: the
#      kernel alone), LENGTHS=1,38,100,512,2048, BATCHES=1,8 (gated_delta.py), VBATCHES=1,8, PASSES=16 (verify_shapes.py),
#      LONG=0 (prompt tokens for the long prefill, e.g. 27000), GDN=1 (0: verify_shapes.py without the kernel),
#      S=/tmp/site, K=/tmp/kit/a, SRC=$PWD/src, MODELS_DIR=/tmp/models, PYTHON=python3.
set -u
PYTHON=${PYTHON:-python3}; S=${S:-/tmp/site}; K=${K:-/tmp/kit/a}; OUT=${OUT:-/tmp/out}; SRC=${SRC:-$PWD/src}
MODELS=${MODELS-"qwen35-9b:4"}; LENGTHS=${LENGTHS:-1,38,100,512,2048}; BATCHES=${BATCHES:-1,8}
VBATCHES=${VBATCHES:-1,8}; PASSES=${PASSES:-16}; LONG=${LONG:-0}; GDN=${GDN:-1}; MODELS_DIR=${MODELS_DIR:-/tmp/models}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"; R=$OUT/results.jsonl
exec > >(tee -a "$OUT/linear_attention.txt") 2>&1
export PYTHONPATH=$S:$SRC PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
if ! "$PYTHON" -c 'import mlx.core' 2> /dev/null; then
  K=$K S=$S bash "$HERE/install.sh" || { echo "no MLX: run 'bash .gpu/a/lay.sh' (.gpu/a along), then this with .gpu/b along"; exit 1; }
fi
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
status=0
timeout 300 "$PYTHON" "$HERE/gated_delta.py" --lengths "$LENGTHS" --batches "$BATCHES" --out "$R" || status=1
gdn=--gdn-kernel; [ "$GDN" = 0 ] && gdn=--no-gdn-kernel
for spec in $MODELS; do
  if [ -d "$spec" ]; then M=$spec
  else
    preset=${spec%%:*}; bits=${spec##*:}; M=$MODELS_DIR/$preset-$bits
    [ -f "$K/tok/tokenizer.json" ] || { echo "no tokenizer in $K/tok: run 'bash .gpu/a/lay.sh' first"; status=1; continue; }
    [ -f $M/config.json ] || "$PYTHON" "$HERE/make_random_model.py" $M $preset $bits $K/tok || { status=1; continue; }
  fi
  echo "== $M $(date +%T)"
  timeout 420 "$PYTHON" "$HERE/verify_shapes.py" --model $M --batches "$VBATCHES" --passes "$PASSES" \
    --long-prompt "$LONG" $gdn --out "$R" || status=1
done
exit $status
