"""Does freeing MLX buffers while the engine's thread captures a CUDA graph abort a process?

MLX's CUDA backend captures cuBLASLt and cuDNN calls into CUDA graphs (thread-local capture
mode). A buffer freed for real (``cudaFree``: the buffer cache over its limit, or
``mx.clear_cache()``) synchronizes the device; while another thread captures, that may
invalidate the capture (``cudaStreamEndCapture ... failed: operation failed due to a previous
error during capture``, then ``terminate``). Each mode runs in its own process for a few
seconds, matmuls of changing shapes on one thread, and prints how the process ended:

  plain      only the matmuls (the baseline)
  limit0     mx.set_cache_limit(0): MLX frees each buffer when done (its own threads)
  freer      a second thread allocates and frees host arrays with the cache limit at 0
  clear      a second thread calls mx.clear_cache() in a loop
  clear_same the matmul thread itself calls mx.clear_cache() between evaluations
  thread_end threads that run attention (cuDNN) and a matmul (cuBLASLt) on the GPU end, one
             after another (their per-thread cuDNN handles are destroyed as each ends)
  thread_kept the same work, on one thread that lives on (engine/core/mlx_threads.py)

    PYTHONPATH=/tmp/site python3 bench/gpu/capture_free.py [--seconds 8] [--out rows.jsonl]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

MODES = ("plain", "limit0", "freer", "clear", "clear_same", "thread_end", "thread_kept")


def child(mode: str, seconds: float) -> None:
    import mlx.core as mx
    import numpy as np

    stop = threading.Event()
    if mode in ("limit0", "freer"):
        mx.set_cache_limit(0)

    def gpu_work() -> None:
        q = mx.random.normal((1, 8, 16, 64)).astype(mx.bfloat16)
        out = mx.fast.scaled_dot_product_attention(q, q, q, scale=0.125)
        mx.eval(out @ mx.ones((64, 64), dtype=mx.bfloat16))

    def other() -> None:
        while not stop.is_set():
            if mode == "thread_end":
                t = threading.Thread(target=gpu_work)
                t.start()
                t.join()
            elif mode == "thread_kept":
                gpu_work()
            elif mode == "freer":
                a = mx.array(np.ones((4096,), dtype=np.float32))
                del a
            else:
                mx.clear_cache()

    helper = (
        threading.Thread(target=other, daemon=True)
        if mode in ("freer", "clear", "thread_end", "thread_kept")
        else None
    )
    w = mx.random.normal((2048, 2048)).astype(mx.bfloat16)
    mx.eval(w)
    if helper is not None:
        helper.start()
    deadline = time.monotonic() + seconds
    steps = 0
    while time.monotonic() < deadline:
        m = 1 + steps % 97
        y = mx.random.normal((m, 2048)).astype(mx.bfloat16)
        for _ in range(8):
            y = y @ w
        mx.eval(y)
        if mode == "clear_same":
            mx.clear_cache()
        steps += 1
    stop.set()
    if helper is not None:
        helper.join(60)  # a thread still in MLX at the interpreter's exit aborts it
    print(json.dumps({"mode": mode, "steps": steps}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    if args.child:
        child(args.child, args.seconds)
        return
    rows = []
    for mode in args.modes.split(","):
        t0 = time.monotonic()
        p = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--seconds", str(args.seconds)],
            capture_output=True,
            text=True,
            timeout=args.seconds + 120,
        )
        tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
        row = {
            "scenario": "capture_free",
            "mode": mode,
            "rc": p.returncode,
            "wall_s": round(time.monotonic() - t0, 1),
            "tail": tail,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
