#!/bin/bash
# On the GPU machine, after `bash bench/gpu/install.sh`: bench/gpu/pass_dispatch.py once per MLX setting (each is
# read once, when MLX starts), for the demo model's shape and the 1B's, into $OUT/dispatch.jsonl and
# $OUT/dispatch.txt. A verify pass's dispatch against a decode step's, per setting, says whether MLX's CUDA graphs
# (at most MLX_MAX_OPS_PER_BUFFER nodes each) bound a small model's pass (docs/benchmarks.md, "an eighth session").
# Env: SETTINGS (space-separated, each VAR=VALUE, "default" for none), SHAPES="demo 1b", PASSES=60, S=/tmp/site.
S=${S:-/tmp/site}; OUT=${OUT:-/tmp/out}; PASSES=${PASSES:-60}; SHAPES=${SHAPES:-"demo 1b"}
SETTINGS=${SETTINGS:-"default MLX_MAX_OPS_PER_BUFFER=60 MLX_MAX_OPS_PER_BUFFER=150 MLX_USE_CUDA_GRAPHS=0"}
mkdir -p "$OUT"
export PYTHONPATH=$S:$PWD/src PYTHONUNBUFFERED=1
for shape in $SHAPES; do
  for setting in $SETTINGS; do
    [ "$setting" = default ] && setting=""
    # shellcheck disable=SC2086
    env $setting timeout 120 python3 bench/gpu/pass_dispatch.py --shape "$shape" --passes "$PASSES" \
      --out "$OUT/dispatch.jsonl" 2>&1 | tee -a "$OUT/dispatch.txt"
  done
done
