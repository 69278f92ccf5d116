#!/bin/bash
# Second run on the GPU machine (.gpu/b along), right after the first (bash .gpu/a/lay.sh): installs MLX for CUDA and
# the wheels into /tmp/site, makes random-weight models of real sizes, and measures, per model, the same work at each
# layer: mlx_lm.stream_generate and mlx_lm's BatchGenerator alone and this project's Engine without HTTP (layers.py),
# the raw engine as the kit has always timed it (raw_engine.py), this server over HTTP and mlx_lm.server
# (bench_openai.py: first burst, single stream, N concurrent streams, prefix-cached chat). Results under $OUT.
# Env: MODELS="1b:4 1b:0 8b:4" (preset:bits; presets in presets.py: 1b, 8b, qwen35-9b (hybrid), gptoss-20b
#      (sliding window + sinks, MoE)), LEVELS=1,8,32, SERVERS="ours mlxlm" (empty: none), RAW=1 (0: skip raw_engine.py),
#      OURS_ARGS="" (extra flags for our server), SRC (the project's src; default the kit's copy, else ./src),
#      BENCH (these scripts; default the kit's copy), PROFILE=1b-0 (py-spy the server on this model at N=32; with
#      PROFILE_EXTRA='{"response_format": ...}' a second burst with those fields, pyspy-<model>-extra.txt; PYSPY=1 prepare.sh),
#      LAYERS=1 (0: skip layers.py), LAYERS_ARGS (e.g. "--skip batch,engine"), LAYERS_ONLY (model names, e.g. "1b-0").
#      SCEN (bench_openai.py scenarios per server; default burst,single,concurrency,prefix),
#      VARIANTS=1 (variants.py against ours: one stream per request variant vs the raw engine doing the same),
#      CONSTRAINED=1 (json_schema vs free at LEVELS, ours; CONSTRAINED_SCHEMA="essay notes": bench_openai.py's, each in turn), CONSTRAINED_ENGINE=1 (constrained_engine.py, no HTTP: the
#      masked step's two orders, batched and launched, against free decoding at 8 and 32 streams; one stream's grammar
#      stepped (batched) and called through its processor (per_row)), LOGPROBS=1 (ours:
#      the concurrency bursts again with each token's top 5 log-probabilities asked, label "ours logprobs5"), LONG_CTX (model names, e.g. "8b-4": the agent session,
#      ~27,670-token system prompt then two turns, run first for its model; LONG_SERVERS="ours mlxlm": ours with
#      defaults and --ctx-size 40000, oursram the same with the RAM tier alone (--prompt-cache-dir ''), mlxlm
#      mlx_lm.server; LONG_TOKENS=23470 is the target given to make_system_prompt: about 27,670 tokens with
#      SmolLM2's tokenizer).
#      FIRST_ANSWER=1: after readiness, time each server to its first 1-token chat answer (the comparable start
#      figure: mlx_lm.server's /health answers before its model is loaded); it warms the server before the burst.
#      A server named ours512 is ours with --prefill-step-size 512, ourspl ours with --prompt-lookup, oursrows ours with
#      4-bit matmuls over 8-32 rows in pieces of 7 (serve_split_rows.py: a measurement).
#      DISK_EVICTIONS=1: disk_evictions.py (no HTTP): two engines with a RAM tier of 2 entries, one with a disk
#      tier, bursts of distinct long prompts (a 400-token system prompt each) at 8 and 32 streams: what handing evicted entries
#      to the disk tier costs the step loop (the saves run on the engine's thread).
#      STEP_GRAPH=1: step_graph.py: one 8-stream decode step's ops, the engine's against BatchGenerator's (seconds).
#      FRESH_KERNELS=1: each server starts on an empty MLX kernel cache (PTX=/tmp/ptx/<server>-<model>), so
#      that readiness and the first answer compare cold against cold (about a minute more per model on 8B).
set -u
K=/tmp/kit/a; S=/tmp/site; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/results.jsonl; L=$OUT/log.txt
# the logs go straight under $OUT: a run cut off at its time limit still brings them back
T=$OUT/logs; mkdir -p $T
MODELS=${MODELS:-"1b:4 1b:0 8b:4"}; LEVELS=${LEVELS:-1,8,32}; SERVERS=${SERVERS-"ours mlxlm"}
SRC=${SRC:-$([ -d $K/src/mlx_server ] && echo $K/src || echo $PWD/src)}; OURS_ARGS=${OURS_ARGS:-}; BENCH=${BENCH:-$K}; PROFILE=${PROFILE:-1b-0}; LAYERS=${LAYERS:-1}
LAYERS_ARGS=${LAYERS_ARGS:-}; LAYERS_ONLY=${LAYERS_ONLY:-}; SCEN=${SCEN:-burst,single,concurrency,prefix}
DISK_EVICTIONS=${DISK_EVICTIONS:-0}; VARIANTS=${VARIANTS:-0}; CONSTRAINED=${CONSTRAINED:-0}; CONSTRAINED_ENGINE=${CONSTRAINED_ENGINE:-0}; LONG_CTX=${LONG_CTX:-}; LONG_SERVERS=${LONG_SERVERS:-"ours mlxlm"}
RAW=${RAW:-1}; FRESH_KERNELS=${FRESH_KERNELS:-0}; PTX=${PTX:-/tmp/ptx}
exec > >(tee -a "$L") 2>&1
K=$K S=$S bash "$(cd "$(dirname "$0")" && pwd)/install.sh" || exit 1
export PYTHONPATH=$S:$SRC PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 - <<'PY' || exit 1
import time, mlx.core as mx
print("mlx", mx.__version__, mx.default_device())
a = mx.random.normal((8192, 8192)).astype(mx.bfloat16); mx.eval(a)
for _ in range(3): mx.eval(a @ a)
t = time.perf_counter(); n = 10
for _ in range(n): mx.eval(a @ a)
print(f"bf16 matmul 8192^3: {2 * 8192**3 * n / (time.perf_counter() - t) / 1e12:.0f} TFLOP/s")
PY
port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
wait_ready() { for _ in $(seq 1 480); do curl -s -m 2 -o /dev/null "http://127.0.0.1:$1/health" && return 0; sleep 0.25; done; return 1; }
first_answer() {  # $1 port, $2 model: one 1-token chat answer, up to 240 s
  # One request may wait that long: on an empty kernel cache an 8B's first answer builds its
  # quantized matmul for 40 s and more, and a request given up is cancelled and asked again
  # (curl -m 60 did: the eighteenth session's 8B read 80.6 s where the server's own log puts
  # its answer at about 70).
  local body='{"model":"'$2'","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
  for _ in $(seq 1 240); do
    [ "$(curl -s -m 240 -o /dev/null -w '%{http_code}' -H 'Content-Type: application/json' -d "$body" \
      "http://127.0.0.1:$1/v1/chat/completions")" = 200 ] && return 0
    sleep 1
  done
  return 1
}
B() { timeout 300 python3 $BENCH/bench_openai.py --base-url "http://127.0.0.1:$1/v1" --model "$2" --label "$3" \
        --scenario "$SCEN" --concurrency "$LEVELS" --conc-max-tokens 128 --max-tokens 256 --server-pid "$4" --out "$R" >/dev/null; }
start_server() {  # $1 server, $2 port, $3 log, $4... extra flags for ours
  local srv=$1 P=$2 log=$3; shift 3
  if [ $srv = mlxlm ]; then setsid python3 -m mlx_lm server --model $M --port $P > $log 2>&1 &
  else setsid python3 -m mlx_server -m $M --port $P --model-id m "$@" > $log 2>&1 & fi
  SP=$!
}
long_ctx() {  # the agent session on each server, one run
  for srv in $LONG_SERVERS; do
    P=$(port); name=m; [ $srv = mlxlm ] && name=default_model
    if [ $srv = oursram ]; then start_server $srv $P $T/long-$srv-$preset-$bits.log --ctx-size 40000 --prompt-cache-dir ''
    else start_server $srv $P $T/long-$srv-$preset-$bits.log --ctx-size 40000; fi
    if wait_ready $P; then
      timeout 300 python3 $BENCH/bench_openai.py --base-url "http://127.0.0.1:$P/v1" --model $name \
        --label "$srv $preset-$bits" --scenario long_ctx --long-system-tokens "${LONG_TOKENS:-23470}" --warmup 1 --out "$R" > /dev/null
    else echo "$srv did not start for long_ctx"; fi
    kill $SP; sleep 2; kill -9 $SP 2>/dev/null
  done
}
for spec in $MODELS; do
  preset=${spec%%:*}; bits=${spec##*:}; M=/tmp/models/$preset-$bits
  [ -f $M/config.json ] || python3 $BENCH/make_random_model.py $M $preset $bits $K/tok || continue
  echo "== $preset bits=$bits $(date +%T)"
  # The agent session first: on a short lease it is the figure wanted most.
  [[ " $LONG_CTX " == *" $preset-$bits "* ]] && long_ctx
  [ "$RAW" = 1 ] && timeout 120 python3 $BENCH/raw_engine.py --model $M --label "raw $preset-$bits" --ignore-eos --max-tokens 256 --repeats 3 --out "$R" >/dev/null
  if [ "$CONSTRAINED_ENGINE" = 1 ]; then
    timeout 100 python3 $PWD/bench/constrained_engine.py --model $M --streams 1 --modes free,batched,per_row,eager \
      --rounds 5 --max-tokens 128 --phases > $T/constrained-engine-$preset-$bits.log 2>&1
    timeout 300 python3 $PWD/bench/constrained_engine.py --model $M --streams 8,32 --modes free,batched,eager \
      --rounds 5 --max-tokens 128 --phases >> $T/constrained-engine-$preset-$bits.log 2>&1
    grep summary $T/constrained-engine-$preset-$bits.log
  fi
  if [ "$DISK_EVICTIONS" = 1 ]; then
    timeout 240 python3 $BENCH/disk_evictions.py --model $M --label "disk $preset-$bits" --levels 8,32 --rounds 5 \
      --out "$R" > $T/disk-evictions-$preset-$bits.log 2>&1
    grep '"what":"ratio"' $T/disk-evictions-$preset-$bits.log
  fi
  if [ "${STEP_GRAPH:-0}" = 1 ]; then
    timeout 120 python3 $BENCH/step_graph.py --model $M --streams 8 > $T/step-graph-$preset-$bits.log 2>&1
    grep '^{' $T/step-graph-$preset-$bits.log
  fi
  if [ "$LAYERS" = 1 ] && { [ -z "$LAYERS_ONLY" ] || [[ " $LAYERS_ONLY " == *" $preset-$bits "* ]]; }; then
    timeout 240 python3 $BENCH/layers.py --model $M --label "layers $preset-$bits" --levels "$LEVELS" $LAYERS_ARGS --out "$R" > $T/layers-$preset-$bits.log 2>&1
  fi
  for srv in $SERVERS; do
    P=$(port); name=m; t0=$(date +%s.%N)
    # FRESH_KERNELS=1: each server on an empty kernel cache (MLX's CUDA backend keeps what it
    # builds on disk, so a server started after another finds it built): cold starts compare.
    if [ "$FRESH_KERNELS" = 1 ]; then
      export MLX_PTX_CACHE_DIR=$PTX/$srv-$preset-$bits; rm -rf "$MLX_PTX_CACHE_DIR"
    fi
    if [ $srv = ours ] || [ $srv = ours512 ] || [ $srv = ourspl ] || [ $srv = oursrows ]; then
      extra=""; [ $srv = ours512 ] && extra="--prefill-step-size 512"
      [ $srv = ourspl ] && extra="--prompt-lookup"
      main="-m mlx_server"; [ $srv = oursrows ] && main="$BENCH/serve_split_rows.py"
      setsid python3 $main -m $M --port $P --model-id m --ctx-size 8192 $OURS_ARGS $extra > $T/$srv-$preset-$bits.log 2>&1 &
    else
      name=default_model  # mlx_lm.server loads the model named in the request; this is its loaded one
      setsid python3 -m mlx_lm server --model $M --port $P > $T/mlxlm-$preset-$bits.log 2>&1 &
    fi
    SP=$!
    if wait_ready $P; then
      echo "$srv ready after $(python3 -c "print(round($(date +%s.%N)-$t0,1))") s"
      # A server's /health may answer before its model is loaded (mlx_lm.server's does):
      # the time to a first answer is the comparable figure.
      t_ready=$(date +%s.%N)
      [ "${FIRST_ANSWER:-0}" = 1 ] && first_answer $P $name && echo "$srv first answer after $(python3 -c "print(round($(date +%s.%N)-$t0,1))") s"
      # With an empty kernel cache: which kernels were built before the readiness line and which
      # the first answer waited for (MLX writes each JIT-built module to the cache as it is built).
      [ "$FRESH_KERNELS" = 1 ] && python3 $BENCH/ptx_times.py "$MLX_PTX_CACHE_DIR" $t0 $t_ready $(date +%s.%N) > $T/ptx-$srv-$preset-$bits.txt 2>&1 \
        && head -30 $T/ptx-$srv-$preset-$bits.txt
      B $P $name "$srv $preset-$bits" $SP  # the server's CPU per 1,000 tokens too
      if [ $srv = ours ] && [ "$VARIANTS" = 1 ]; then
        timeout 300 python3 $BENCH/variants.py --model $M --base-url "http://127.0.0.1:$P/v1" \
          --label "variants $preset-$bits" --max-tokens 256 --repeats 5 --out "$R" > $T/variants-$preset-$bits.log 2>&1
      fi
      if [ $srv = ours ] && [ "${LOGPROBS:-0}" = 1 ]; then  # the same bursts, each token's top 5 asked
        timeout 200 python3 $BENCH/bench_openai.py --base-url "http://127.0.0.1:$P/v1" --model m --label "ours logprobs5 $preset-$bits" \
          --scenario concurrency --concurrency "$LEVELS" --conc-max-tokens 128 --warmup 1 \
          --conc-extra '{"logprobs": true, "top_logprobs": 5}' --out "$R" > /dev/null
      fi
      if [ $srv = ours ] && [ "$CONSTRAINED" = 1 ]; then
        for schema in ${CONSTRAINED_SCHEMA:-essay}; do
          timeout 240 python3 $BENCH/bench_openai.py --base-url "http://127.0.0.1:$P/v1" --model m --label "ours-$schema $preset-$bits" \
            --scenario constrained --constrained-rounds 5 --concurrency "$LEVELS" --conc-max-tokens 128 --warmup 1 \
            --constrained-schema $schema --out "$R" > /dev/null
        done
      fi
      if [ $srv = ours ] && [ "$preset-$bits" = "$PROFILE" ] && [ -x $S/bin/py-spy ]; then
        $S/bin/py-spy record --pid $SP --duration 8 --rate 250 --threads --idle --format raw -o $T/pyspy-$preset-$bits.txt > /dev/null 2>&1 &
        YP=$!
        timeout 60 python3 $BENCH/bench_openai.py --base-url "http://127.0.0.1:$P/v1" --model m --label "profiled $preset-$bits" \
          --scenario concurrency --concurrency 32,32 --conc-max-tokens 128 --warmup 0 > /dev/null 2>&1
        wait $YP
        if [ -n "${PROFILE_EXTRA:-}" ]; then  # the same burst, each request with these fields
          $S/bin/py-spy record --pid $SP --duration 8 --rate 250 --threads --idle --format raw -o $T/pyspy-$preset-$bits-extra.txt > /dev/null 2>&1 &
          YP=$!
          timeout 60 python3 $BENCH/bench_openai.py --base-url "http://127.0.0.1:$P/v1" --model m --label "profiled extra $preset-$bits" \
            --scenario concurrency --concurrency 32,32 --conc-max-tokens 128 --warmup 0 --conc-extra "$PROFILE_EXTRA" > /dev/null 2>&1
          wait $YP
        fi
      fi
    else echo "$srv did not start"; tail -5 $T/$srv-$preset-$bits.log; fi
    kill $SP; sleep 2; kill -9 $SP 2>/dev/null
    # Our start's phases, the warm-up, and the first generations (rates, waits) in the output itself.
    [ $srv != mlxlm ] && grep -hE "Start:|Warm-up|Attention:|Linear attention:|Generation:|Slow engine step" $T/$srv-$preset-$bits.log | head -12
  done
  :  # the logs are under $OUT/logs already
done
python3 $BENCH/summary.py "$R"
