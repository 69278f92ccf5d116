"""Time each sampler's first and second run on a cold MLX kernel cache (``MLX_PTX_CACHE_DIR``
set to an empty folder): what a server's first request with new sampling settings pays
before its prefill; a setting's other values should find its kernels built (the values
are arrays, not constants of the kernels). Usage: ``python bench/gpu/sampler_cold.py [vocab] [dtype]``."""

import sys
import time

import mlx.core as mx

from mlx_server.engine.sampling.samplers import SamplingParams, make_sampler

vocab = int(sys.argv[1]) if len(sys.argv) > 1 else 128256
dtype = getattr(mx, sys.argv[2] if len(sys.argv) > 2 else "bfloat16")
cases = [
    ("zeros", None, ()),
    ("greedy", SamplingParams(temperature=0.0), ()),
    ("greedy, eos banned", SamplingParams(temperature=0.0), (1, 2)),
    ("temperature 0.7", SamplingParams(temperature=0.7), ()),
    ("temperature 1.0 (another value)", SamplingParams(temperature=1.0), ()),
    ("temperature 0.7, top_p 0.9", SamplingParams(temperature=0.7, top_p=0.9), ()),
    ("temperature 0.3, top_p 0.5 (other values)", SamplingParams(temperature=0.3, top_p=0.5), ()),
    ("temperature 0.7, top_k 40", SamplingParams(temperature=0.7, top_k=40), ()),
    ("temperature 0.7, min_p 0.05", SamplingParams(temperature=0.7, min_p=0.05), ()),
    ("temperature 0.9, min_p 0.1 (other values)", SamplingParams(temperature=0.9, min_p=0.1), ()),
    ("temperature 1.0, top_p 0.95, seed", SamplingParams(temperature=1.0, top_p=0.95, seed=3), ()),
]
for name, params, ban in cases:
    times = []
    for _ in range(2):
        t = time.perf_counter()
        x = mx.zeros((1, vocab), dtype=dtype)
        mx.eval(x if params is None else make_sampler(params, ban)(x))
        times.append(time.perf_counter() - t)
    print(
        f"{name:44s} first {times[0] * 1000:8.1f} ms, again {times[1] * 1000:6.1f} ms", flush=True
    )
