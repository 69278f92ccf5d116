"""What a 4-bit matmul costs per number of rows on this device: the batch's decode step
multiplies N rows (one token per sequence) by every weight. On the H100 (MLX 0.32.4) an 8B
4-bit model's step took 5.4 ms for one sequence, 30.6 ms for 8 and 108 ms for 32: MLX
multiplies fewer than 8 rows with a matrix-vector kernel (``qmv``) and 8 or more with a
CUTLASS tile kernel (``qmm_sm80``, built per tile of 16/32/64 rows). This times, for an 8B
model's four weight shapes, ``mx.quantized_matmul`` over M rows at once, over the same rows
in pieces of at most 7 (each piece on the matrix-vector kernel), and a bf16 matmul of the
same shape (what the tile kernel would need to approach); one line per M.

    python bench/gpu/qmm_rows.py [bits] [group_size] [M ...]
"""

import os
import sys
import time

import mlx.core as mx

bits = int(sys.argv[1]) if len(sys.argv) > 1 else 4
group = int(sys.argv[2]) if len(sys.argv) > 2 else 64
rows = [int(a) for a in sys.argv[3:]] or [1, 2, 4, 7, 8, 9, 12, 16, 17, 24, 32, 48, 64]
# Llama 3.1 8B: q/o (4096x4096), k/v (1024x4096), gate/up (14336x4096), down (4096x14336)
SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]
LAYERS = int(os.environ.get("LAYERS", "32"))
COUNTS = [2, 2, 2, 1]  # per layer: q+o, k+v, gate+up, down
dtype = mx.bfloat16
weights = []
for n, k in SHAPES:
    w = mx.random.normal((n, k), dtype=dtype) * 0.02
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    weights.append((w, q, s, b))
mx.eval(weights)


def whole(x, q, s, b):
    return mx.quantized_matmul(x, q, s, b, transpose=True, group_size=group, bits=bits)


def pieces(x, q, s, b):
    m = x.shape[0]
    if m < 8:
        return whole(x, q, s, b)
    parts = [whole(x[i : i + 7], q, s, b) for i in range(0, m, 7)]
    return mx.concatenate(parts, axis=0)


def dense(x, w):
    return x @ w.T


def timed(fn, m: int) -> float:
    """Seconds of one model's worth of these matmuls (LAYERS layers) for M rows, best of 5."""
    xs = [mx.random.normal((m, k), dtype=dtype) for _, k in SHAPES]
    mx.eval(xs)

    def layer():
        outs = []
        for (w, q, s, b), x, c in zip(weights, xs, COUNTS, strict=True):
            for _ in range(c):
                outs.append(fn(x, w, q, s, b))
        return outs

    for _ in range(2):  # build kernels, warm caches
        mx.eval(layer())
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        mx.eval([layer() for _ in range(LAYERS)])
        best = min(best, time.perf_counter() - t)
    return best


print(
    f"mlx {mx.__version__} on {mx.default_device()}; {bits}-bit, group {group}; ms per "
    f"{LAYERS} layers of an 8B model's matmuls"
)
for m in rows:
    t0 = time.perf_counter()
    a = timed(lambda x, w, q, s, b: whole(x, q, s, b), m)
    build = time.perf_counter() - t0
    p = timed(lambda x, w, q, s, b: pieces(x, q, s, b), m)
    d = timed(lambda x, w, q, s, b: dense(x, w), m)
    print(
        f"M={m:3d}: at once {a * 1e3:7.2f}  in pieces of <= 7 {p * 1e3:7.2f}  bf16 {d * 1e3:7.2f}"
        f"  (first call with builds {build:.1f} s)",
        flush=True,
    )
