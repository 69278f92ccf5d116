#!/bin/bash
# On the GPU machine after lay.sh and install.sh: one server start on an empty kernel cache
# (the random 1B bf16 unless M= names a model folder), then two requests with sampling
# settings it has not met (temperature 0.7, then temperature 0.9 with top-p 0.5): the start
# lines, each request's seconds and the slow-step lines. What the sampler warm-up left to
# the first request shows in its `starting requests`.
set -u
S=${S:-/tmp/site}; K=${K:-/tmp/kit/a}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$S:$PWD/src PYTHONUNBUFFERED=1 MLX_PTX_CACHE_DIR=/tmp/ptx-first
rm -rf "$MLX_PTX_CACHE_DIR"
M=${M:-/tmp/models/1b-0}
[ -f "$M/config.json" ] || python3 "$(dirname "$0")/make_random_model.py" "$M" 1b 0 "$K/tok" > /dev/null || exit 1
LOG=$OUT/first-request-server.log; T0=$(date +%s.%N)
python3 -m mlx_server -m "$M" --port 8111 --model-id m --ctx-size 8192 > "$LOG" 2>&1 &
PID=$!
python3 - "$LOG" <<'PY'
import sys, time, httpx
log, t0 = sys.argv[1], time.monotonic()
while "server is listening" not in open(log).read():
    if time.monotonic() - t0 > 240:
        sys.exit("no readiness line in 240 s")
    time.sleep(0.1)
print(f"ready after {time.monotonic() - t0:.1f} s (from the poll's start)")
open(log + ".ready", "w").write(str(time.time()))
for body in ({"temperature": 0.7}, {"temperature": 0.9, "top_p": 0.5}):
    t = time.monotonic()
    r = httpx.post("http://127.0.0.1:8111/v1/chat/completions", timeout=300, json={
        "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello there"}], **body})
    print(f"{body}: {r.status_code} in {time.monotonic() - t:.2f} s")
PY
kill $PID; wait $PID 2>/dev/null
grep -hE "Warm-up|Start:|Slow|Generation:" "$LOG"
# the kernels JIT-built before the readiness line and during the two requests
python3 "$K/ptx_times.py" "$MLX_PTX_CACHE_DIR" "$T0" "$(cat "$LOG.ready")" "$(date +%s.%N)" | head -30
