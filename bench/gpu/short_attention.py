#!/usr/bin/env python3
"""Does a short query's attention build a cuDNN graph at every new key length on CUDA, and
does computing it plainly (models/cuda_attention.py) avoid that? A speculative verify pass
(2 or 9 tokens) or a short prefill chunk (32) over key lengths never seen before, 16 of them,
then the same 16 again: MLX's fused attention (cuDNN for 2+ tokens in half precision)
against the plain computation, each timed alone (evaluated, synchronised).

  PYTHONPATH=/tmp/site:$PWD/src python3 bench/gpu/short_attention.py --out $OUT/short_attention.jsonl

Prints, per case, the median and the largest time of each round; a round 1 far slower than
round 2 is a build per shape, not work."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, "..", "..", "src"))

import mlx.core as mx  # noqa: E402

from mlx_server.models.cuda_attention import plain_attention  # noqa: E402

FUSED = mx.fast.scaled_dot_product_attention


def timed(fn, q, k, v) -> float:
    t0 = time.perf_counter()
    mx.eval(fn(q, k, v, scale=q.shape[-1] ** -0.5, mask="causal"))
    mx.synchronize()
    return (time.perf_counter() - t0) * 1000


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2,9,32,128,256")
    ap.add_argument("--keys", default="300,4000", help="the first key length of each run of 16")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--offsets", type=int, default=16)
    ap.add_argument("--out")
    a = ap.parse_args()
    print(f"mlx {mx.__version__} {mx.default_device()}", flush=True)
    cases = [
        (dim, batch, length, base)
        for dim in map(int, a.dims.split(","))
        for batch in map(int, a.batches.split(","))
        for length in map(int, a.lengths.split(","))
        for base in map(int, a.keys.split(","))
    ]
    for dim, batch, length, base in cases:
        for name, fn in (("fused", FUSED), ("plain", plain_attention)):
            rounds = []
            for _ in range(2):
                times = []
                for i in range(a.offsets):
                    keys = base + 9 * i + length
                    shape_q, shape_kv = (batch, 32, length, dim), (batch, 8, keys, dim)
                    q = mx.random.normal(shape_q).astype(mx.bfloat16)
                    k = mx.random.normal(shape_kv).astype(mx.bfloat16)
                    v = mx.random.normal(shape_kv).astype(mx.bfloat16)
                    mx.eval(q, k, v)
                    times.append(timed(fn, q, k, v))
                rounds.append(times)
            row = {"scenario": "short_attention", "impl": name, "dim": dim}
            row.update(batch=batch, length=length, keys=base, offsets=a.offsets)
            for r, times in enumerate(rounds, 1):
                row[f"round{r}_median_ms"] = round(statistics.median(times), 3)
                row[f"round{r}_max_ms"] = round(max(times), 3)
            print(json.dumps(row), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
