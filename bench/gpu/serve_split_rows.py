"""Our server with every 4-bit matmul over 8 to ``SPLIT_ROWS_MAX`` rows (default 32) done in
pieces of at most 7 rows, for ``device_bench.sh``'s ``oursrows`` server: MLX's CUDA backend
multiplies fewer than 8 rows with a matrix-vector kernel and 8 or more with a tile kernel
that cost an 8B model's batch of 8 5.7 times one row's step on the H100 (``qmm_rows.py``
times the matmuls alone). A measurement, not a setting: the server's own code is unchanged.

    python3 serve_split_rows.py [mlx_server's arguments]
"""

import os
import sys

import mlx.core as mx
import mlx.nn as nn

PIECE = 7
MAX_ROWS = int(os.environ.get("SPLIT_ROWS_MAX", "32"))
_call = nn.QuantizedLinear.__call__


def _split_rows(self, x):
    rows = x.size // x.shape[-1]
    if rows < PIECE + 1 or rows > MAX_ROWS:
        return _call(self, x)
    flat = x.reshape(rows, x.shape[-1])
    parts = [_call(self, flat[i : i + PIECE]) for i in range(0, rows, PIECE)]
    return mx.concatenate(parts, axis=0).reshape(*x.shape[:-1], -1)


nn.QuantizedLinear.__call__ = _split_rows

if __name__ == "__main__":
    from mlx_server.cli import main

    sys.argv[0] = "mlx_server"
    raise SystemExit(main())
