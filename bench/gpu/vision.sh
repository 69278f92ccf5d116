#!/bin/bash
# Vision-language serving on the GPU machine: a random-weight Qwen2.5-VL-7B-like model, 4-bit
# (make_random_vlm.py), served by this server and by mlx_vlm.server in one run, the same scenarios
# against each (bench_vision.py: one stream, N concurrent streams with images, a three-turn session on
# one image, a text-only request), and the text-only request again against the VLM's text twin (the same
# language model as a plain mlx-lm model) served by this server. Prints the ratios; JSON lines, the log
# and the servers' logs under $OUT.
#
# How to run it (three GPU calls, each right after the last, so the machine stays warm):
#   bash bench/gpu/prepare.sh                                   # here: .gpu/a, .gpu/b, .gpu/v
#   bash .gpu/a/lay.sh                                          # GPU 1, carry .gpu/a
#   bash bench/gpu/install.sh                                   # GPU 2, carry .gpu/b
#   bash /tmp/kit/a/vision.sh                                   # GPU 3, carry .gpu/v
# or in two calls: after lay.sh, 'bash /tmp/kit/a/vision.sh' with both .gpu/b and .gpu/v along (54 MB).
# Should one call not hold it all (10 minutes), split the servers over two calls, the models kept:
#   SERVERS=ours bash /tmp/kit/a/vision.sh; then SERVERS=mlxvlm bash /tmp/kit/a/vision.sh (the summary
#   reads both calls' lines from $ALL).
# A dry run on a CPU (no install, the tiny preset):
#   NO_INSTALL=1 PRESET=tiny-qwen25vl TOK=models/smollm2-135m-instruct PYTHON=.venv/bin/python \
#     SRC=$PWD/src MAX_TOKENS=16 SIZE=112 REPEATS=1 N=4 OUT=/tmp/vision-out bash bench/gpu/vision.sh
#
# Env: PRESET=qwen25vl-7b (or tiny-qwen25vl), BITS=4, SERVERS="ours mlxvlm", N=8 (concurrent streams),
#      MAX_TOKENS=128, SIZE=420 (image side; at 448, a multiple of Qwen2.5-VL's attention window,
#      mlx-vlm 0.7.10 runs empty attention segments, which kill mlx_vlm.server on CUDA with SIGFPE;
#      this server repairs them: models/vlm_repairs.py), SESSION_SIZE=840 (the session's image: a photo's
#      900 image tokens make turn 1's prompt, 30 x 30 merged patches, no window multiple), REPEATS=3, SCEN=single,concurrent,session,text,
#      TWIN=1 (0: skip the text twin), OURS_ARGS (extra flags for this server), NO_INSTALL=1 (use what
#      PYTHON has), V (the mlx-vlm wheels; default .gpu/v), PYTHON=python3, S=/tmp/site, K=/tmp/kit/a,
#      TOK=$K/tok, SRC (default the kit's copy, else ./src), MODELS_DIR=/tmp/models, OUT=/tmp/out,
#      ALL=/tmp/vision-results.jsonl (every call's lines, for the summary), PTX=/tmp/ptx (each server's
#      own MLX kernel cache, emptied before it starts: the first_use line is cold for both servers).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}; S=${S:-/tmp/site}; K=${K:-/tmp/kit/a}; OUT=${OUT:-/tmp/out}; TOK=${TOK:-$K/tok}
SRC=${SRC:-$([ -d $K/src/mlx_server ] && echo $K/src || echo $PWD/src)}; MODELS_DIR=${MODELS_DIR:-/tmp/models}
PRESET=${PRESET:-qwen25vl-7b}; BITS=${BITS:-4}; SERVERS=${SERVERS-"ours mlxvlm"}; N=${N:-8}
MAX_TOKENS=${MAX_TOKENS:-128}; SIZE=${SIZE:-420}; SESSION_SIZE=${SESSION_SIZE:-840}; REPEATS=${REPEATS:-3}; SCEN=${SCEN:-single,concurrent,session,text}
TWIN=${TWIN:-1}; OURS_ARGS=${OURS_ARGS:-}; V=${V:-.gpu/v}; PTX=${PTX:-/tmp/ptx}
mkdir -p "$OUT"; R=$OUT/results.jsonl; T=$OUT/logs; mkdir -p "$T"; ALL=${ALL:-/tmp/vision-results.jsonl}
exec > >(tee -a "$OUT/vision.txt") 2>&1
if [ "${NO_INSTALL:-0}" != 1 ]; then
  K=$K S=$S bash "$HERE/install.sh" || exit 1
  if [ ! -d $S/mlx_vlm ]; then
    ls $V/mlx_vlm-*.whl > /dev/null 2>&1 || { echo "no mlx-vlm wheels in $V: carry .gpu/v"; exit 1; }
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S $V/*.whl || exit 1
  fi
  export PYTHONPATH=$S:$SRC
else
  export PYTHONPATH=$SRC
fi
export PYTHONUNBUFFERED=1
"$PYTHON" -c 'import mlx.core as mx, mlx_vlm; print("mlx", mx.__version__, mx.default_device(), "mlx-vlm", mlx_vlm.__version__)' || exit 1
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
M=$MODELS_DIR/$PRESET-$BITS; MT=$MODELS_DIR/$PRESET-$BITS-text
if [ ! -f $M/config.json ] || [ ! -f $MT/config.json ]; then
  t0=$(date +%s)
  "$PYTHON" "$HERE/make_random_vlm.py" $M $PRESET $BITS $TOK --text $MT || exit 1
  echo "models made in $(( $(date +%s) - t0 )) s"
fi
port() { "$PYTHON" -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
wait_ready() {  # $1 port, $2 pid: up to 240 s, while the server lives
  "$PYTHON" - "$1" "$2" <<'PY'
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 240
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(1)
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        sys.exit(0)
    except Exception:
        time.sleep(0.25)
sys.exit(1)
PY
}
bench() {  # $1 port, $2 model name, $3 server, $4 kind, $5 scenarios
  timeout 480 "$PYTHON" "$HERE/bench_vision.py" --base-url "http://127.0.0.1:$1/v1" --model "$2" --server $3 \
    --kind $4 --label "$3 $4 $PRESET-$BITS" --scenario "$5" --concurrency $N --max-tokens $MAX_TOKENS \
    --size $SIZE --session-size $SESSION_SIZE --repeats $REPEATS --out "$R" || echo "!! bench_vision.py: $3 $4 exit status $?"
}
serve() {  # $1 server, $2 model dir, $3 kind, $4 scenarios
  local P; P=$(port); local log=$T/$1-$3.log; local name=m; local t0; t0=$(date +%s)
  # A fresh kernel cache for each server: MLX's CUDA backend keeps the kernels it builds on
  # disk (/tmp/mlx/<version>/ptx), so a server started after another would find them built.
  export MLX_PTX_CACHE_DIR=$PTX/$1-$3; rm -rf "$MLX_PTX_CACHE_DIR"
  if [ $1 = mlxvlm ]; then
    name=$2; setsid "$PYTHON" -m mlx_vlm.server --model $2 --port $P > $log 2>&1 &
  else
    # shellcheck disable=SC2086
    setsid "$PYTHON" -m mlx_server -m $2 --port $P --model-id m --ctx-size 8192 $OURS_ARGS > $log 2>&1 &
  fi
  local SP=$!
  if wait_ready $P $SP; then
    echo "== $1 $3 ready after $(( $(date +%s) - t0 )) s"
    bench $P "$name" $1 $3 "$4"
  else echo "!! $1 $3 did not start"; tail -5 $log; fi
  kill $SP 2> /dev/null; for _ in $(seq 1 20); do kill -0 $SP 2> /dev/null || break; sleep 0.5; done
  kill -9 $SP 2> /dev/null; wait $SP 2> /dev/null
  # Our start's phases, the warm-up, and the first uses' generations (rates, waits) in the output.
  [ $1 != mlxvlm ] && grep -hE "Start:|Warm-up|Attention:|Generation:|Slow engine step" $log | head -16
  return 0
}
for srv in $SERVERS; do
  serve $srv $M vlm "$SCEN"
  [ $srv = ours ] && [ "$TWIN" = 1 ] && [[ ",$SCEN," == *",text,"* ]] && serve ours $MT twin text
done
# The summary reads every run's lines kept on this machine ($ALL: a later call with other SERVERS adds
# to it; the last line of each server, kind and scenario counts).
cat "$R" >> "$ALL" 2> /dev/null; cp "$ALL" "$OUT/all-results.jsonl"
"$PYTHON" "$HERE/bench_vision.py" --summary "$ALL" --out "$R"
