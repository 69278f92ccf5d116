#!/usr/bin/env python3
"""Does attention build a cuDNN graph at every new key length on CUDA, and what avoids it?
Three kinds of call, each over key lengths never seen before (16 of them), then the same 16
again, each call timed alone (evaluated, synchronised):

- ``short``: a speculative verify pass (2 or 9 tokens) or a short prefill chunk (32 to 256)
  over new key lengths: MLX's fused attention (cuDNN for 2+ tokens in half precision)
  against the plain computation (models/cuda_attention.py);
- ``padded`` (queries of 65 tokens or more): the fused attention over the exact keys against
  the same with the keys padded to a multiple of 256 and an additive mask hiding the
  padding (what a prefill chunk after a cached prefix of any length could send, so that
  its shapes repeat);
- ``decode``: one token over a slice of a key buffer whose length is a multiple of 256 (what
  a lone sequence's ``KVCache`` holds after a cold prompt), each call a new buffer length:
  MLX gives such a call to cuDNN from 256 keys on (``use_cudnn_for_decoding``), a graph
  per buffer length; against the same keys copied out of the buffer (MLX's vector kernel).

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
BLOCK = 256  # mlx-lm's KVCache grows its buffers by this many positions


def timed(fn, q, k, v, mask="causal") -> float:
    t0 = time.perf_counter()
    mx.eval(fn(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask))
    mx.synchronize()
    return (time.perf_counter() - t0) * 1000


def padded(q, k, v, *, scale, mask="causal"):
    """Causal attention with the keys padded to a multiple of ``BLOCK``: an additive mask
    hides the padding and the future (the query is the last positions of the real keys)."""
    length, keys = q.shape[2], k.shape[2]
    total = -(-keys // BLOCK) * BLOCK
    pad = [(0, 0), (0, 0), (0, total - keys), (0, 0)]
    k, v = mx.pad(k, pad), mx.pad(v, pad)
    rows = mx.arange(keys - length, keys)[:, None]
    low = mx.array(mx.finfo(q.dtype).min, dtype=q.dtype)
    bias = mx.where(mx.arange(total)[None, :] <= rows, mx.array(0, dtype=q.dtype), low)
    return FUSED(q, k, v, scale=scale, mask=bias)


def buffer_slice(batch: int, dim: int, total: int, keys: int) -> tuple[mx.array, mx.array]:
    """Keys and values as a lone sequence's cache hands them to attention: the first
    ``keys`` positions of a buffer of ``total`` (evaluated, so MLX sees the slice)."""
    shape = (batch, 8, total, dim)
    kb = mx.random.normal(shape).astype(mx.bfloat16)
    vb = mx.random.normal(shape).astype(mx.bfloat16)
    k, v = kb[:, :, :keys], vb[:, :, :keys]
    mx.eval(k, v)
    return k, v


def case_inputs(mode: str, batch: int, dim: int, length: int, base: int, i: int, impl: str):
    """Call ``i`` of a round: q, k, v and the mask."""
    if mode == "decode":  # buffer lengths base, base + 256, ...: one new length per call
        total = -(-base // BLOCK) * BLOCK + BLOCK * i
        k, v = buffer_slice(batch, dim, total, total - 3)
        if impl == "copied":
            k, v = mx.contiguous(k * 1), mx.contiguous(v * 1)
            mx.eval(k, v)
        q = mx.random.normal((batch, 32, 1, dim)).astype(mx.bfloat16)
        mx.eval(q)
        return q, k, v, None
    keys = base + 9 * i + length
    shape_q, shape_kv = (batch, 32, length, dim), (batch, 8, keys, dim)
    q = mx.random.normal(shape_q).astype(mx.bfloat16)
    k = mx.random.normal(shape_kv).astype(mx.bfloat16)
    v = mx.random.normal(shape_kv).astype(mx.bfloat16)
    mx.eval(q, k, v)
    return q, k, v, "causal"


IMPLS = {
    "short": (("fused", FUSED), ("plain", plain_attention)),
    "padded": (("fused", FUSED), ("padded", padded)),
    "decode": (("fused", FUSED), ("copied", FUSED)),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="short,padded,decode")
    ap.add_argument("--lengths", default="2,9,32,128,256,512", help="query lengths of 'short'")
    ap.add_argument("--padded-lengths", default="128,512,2048", help="query lengths of 'padded'")
    ap.add_argument("--keys", default="300,4000", help="the first key length of each run of 16")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--offsets", type=int, default=16)
    ap.add_argument("--out")
    a = ap.parse_args()
    print(f"mlx {mx.__version__} {mx.default_device()}", flush=True)
    lengths = {
        "short": [int(x) for x in a.lengths.split(",")],
        "padded": [int(x) for x in a.padded_lengths.split(",")],
        "decode": [1],
    }
    cases = [
        (mode, dim, batch, length, base)
        for mode in a.modes.split(",")
        for dim in map(int, a.dims.split(","))
        for batch in ([1] if mode == "decode" else map(int, a.batches.split(",")))
        for length in lengths[mode]
        for base in map(int, a.keys.split(","))
    ]
    for mode, dim, batch, length, base in cases:
        for name, fn in IMPLS[mode]:
            rounds = []
            for _ in range(2):
                times = []
                for i in range(a.offsets):
                    q, k, v, mask = case_inputs(mode, batch, dim, length, base, i, name)
                    times.append(timed(fn, q, k, v, mask))
                rounds.append(times)
            row = {"scenario": "short_attention", "mode": mode, "impl": name, "dim": dim}
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
