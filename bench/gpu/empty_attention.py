"""Reproduces, on the GPU machine, what killed both vision servers on a 448x448 image (issue 37):
``mx.fast.scaled_dot_product_attention`` over a segment with zero queries, which mlx-vlm 0.7.10's
Qwen2.5-VL tower runs where window boundaries repeat (``models/vlm_repairs.py``). With MLX CUDA
0.32.4 the process dies of SIGFPE at the empty segment; on Metal and the CPU the segment gives an
empty output and the script prints "survived".

    PYTHONPATH=/tmp/site python3 bench/gpu/empty_attention.py     # after lay.sh and install.sh
"""

from __future__ import annotations

import faulthandler

import mlx.core as mx

faulthandler.enable()
q = mx.random.normal((1, 16, 1024, 80)).astype(mx.bfloat16)  # a tower's (batch, heads, L, 80)
for part in mx.split(q, [256, 256, 512], axis=2):  # a repeated boundary: lengths 256, 0, 256, 512
    print("segment of", part.shape[2], "queries", flush=True)
    out = mx.fast.scaled_dot_product_attention(part, part, part, scale=80**-0.5, mask=None)
    mx.eval(out)
print("survived", mx.default_device())
