#!/bin/bash
# Speculative decoding on the GPU machine: bench/speculative.py, every run through the server's own engine (one stream
# and STREAMS streams, with and without speculation in one run, ratios printed): the code edit and prose with prompt
# lookup, the Predicted Outputs ceiling (each request predicts its own plain answer with a 10-token span in the middle
# changed), and random drafts (nothing to accept: must stay near 1.0x). Each speculating run prints the plan's
# decisions and the verify cost it measured per batch size and width (and the samples it left out as kernel builds,
# how often and why drafting stopped); each engine's warm-up, verify passes included, ends before timing; where an
# answer parts from plain greedy decoding, the top-2 margin there. Models: the demo model dequantized to float16 and
# random-weight models of real sizes (their answers are noise, the predicted outputs still match exactly).
#
# How to run it next session (six GPU calls, each right after the last, so the machine stays warm; see
# docs/benchmarks.md, "Speculative decoding"):
#   bash bench/gpu/prepare.sh && bash bench/gpu/prepare_demo.sh                         # here
#   bash .gpu/a/lay.sh                                                                   # GPU 1, carry .gpu/a
#   bash bench/gpu/install.sh && bash bench/gpu/park_demo.sh                             # GPU 2, carry .gpu/b .gpu/d1
#   bash bench/gpu/park_demo.sh                                                          # GPU 3, carry .gpu/d2
#   bash bench/gpu/park_demo.sh && MODELS=demo bash bench/gpu/speculative.sh            # GPU 4, carry .gpu/d3
#   MODELS="1b:0" bash bench/gpu/speculative.sh                                          # GPU 5
#   MODELS="8b:4" bash bench/gpu/speculative.sh                                          # GPU 6
# One model per call: a call may run 10 minutes, and one model's rows take about 5 (estimated; PER_MODEL_S caps it
# at 9). All six need about 25 of a session's 30 device minutes; if fewer are left, run WORKLOADS=predicted,code
# first (the ceiling and the lookup; prose and random drafts stay in each workload's rows).
# Each call's $OUT comes back: results.jsonl, speculative.txt (the log), trace-*.log (one line per verifying step,
# written before its pass runs).
#
# If the process dies (the CUDA abort seen once at 8 streams with random drafts on random 1B: cudaStreamEndCapture
# ... failed, terminate called), the log has: the exit status and signal, every Python thread's stack at the abort
# (python -X faulthandler: which of our lines was running, and whether a second thread was in MLX), and the tail of
# that model's trace (the shape of the last verify pass: batch size, width, each row's draft length). See
# docs/speculative-decoding.md, "Robustness on CUDA", for what was changed and why.
#
# Env: MODELS="demo 1b:0 8b:4" (demo: the parked demo model; preset:bits: a random-weight model made here, preset:bits:d
#      a decisive one, whose greedy answer has no near-ties (make_random_model.py --decisive); a folder:
#      that model), TOKENS=200, KS=15 (draft lengths, each run at every level), REPEAT=1, STREAMS=8, LEVELS (default
#      1,STREAMS), WORKLOADS=code,prose,predicted, PER_MODEL_S=540, PARK=/tmp/kit/demo, MODELS_DIR=/tmp/models,
#      DTYPE=float16 (the demo model's), PYTHON=python3, S=/tmp/site, K=/tmp/kit/a, SRC=$PWD/src,
#      SPEC_ARGS (more flags for bench/speculative.py, e.g. --compare-queued: at one stream, each drafter's run
#      again with the lone sequence's passes read before the next is built, to compare).
set -u
PYTHON=${PYTHON:-python3}; S=${S:-/tmp/site}; K=${K:-/tmp/kit/a}; OUT=${OUT:-/tmp/out}; SRC=${SRC:-$PWD/src}
MODELS=${MODELS:-"demo 1b:0 8b:4"}; TOKENS=${TOKENS:-200}; KS=${KS:-15}; REPEAT=${REPEAT:-1}; STREAMS=${STREAMS:-8}
LEVELS=${LEVELS:-1,$STREAMS}; WORKLOADS=${WORKLOADS:-code,prose,predicted}
PARK=${PARK:-/tmp/kit/demo}; MODELS_DIR=${MODELS_DIR:-/tmp/models}
PER_MODEL_S=${PER_MODEL_S:-540}; DTYPE=${DTYPE:-float16}; HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"; R=$OUT/results.jsonl
exec > >(tee -a "$OUT/speculative.txt") 2>&1
export PYTHONPATH=$S:$SRC PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
"$PYTHON" -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())' || exit 1
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
env | grep -E '^(MLX_|CUDA_)' || true
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
    # preset:bits, or preset:bits:d for a decisive one (make_random_model.py --decisive)
    IFS=: read -r preset bits dec <<< "$spec"; flag=""; [ "$dec" = d ] && flag=--decisive
    M=$MODELS_DIR/$preset-$bits${dec:+-$dec}; label="random $preset-$bits${dec:+-$dec}"; extra=""
    [ -f $M/config.json ] || "$PYTHON" "$HERE/make_random_model.py" $M $preset $bits $K/tok $flag || { status=1; continue; }
  fi
  trace=$OUT/trace-${label// /-}.log
  echo "== $label $(date +%T)"
  # shellcheck disable=SC2086
  timeout "$PER_MODEL_S" "$PYTHON" -X faulthandler bench/speculative.py --model $M $extra --tokens "$TOKENS" \
    --num-draft-tokens "$KS" --repeat "$REPEAT" --streams "$STREAMS" --levels "$LEVELS" --workloads "$WORKLOADS" \
    --json "$R" --label "$label" --trace "$trace" ${SPEC_ARGS:-}
  rc=$?
  if [ $rc != 0 ]; then
    status=1
    echo "!! $label: exit status $rc$([ $rc -gt 128 ] && echo " (signal $((rc - 128)))")$([ $rc = 124 ] && echo " (timed out after ${PER_MODEL_S}s)")"
    echo "!! the last verify passes before it ended ($trace):"; tail -5 "$trace" 2>/dev/null
  fi
done
exit $status
