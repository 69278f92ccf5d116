#!/usr/bin/env python3
"""Where a small model's forward pass spends its time on a GPU, by phase: building the graph
in Python, MLX's dispatch (``mx.async_eval``: on CUDA, kernels recorded into CUDA graphs of
up to ``MLX_MAX_OPS_PER_BUFFER`` nodes, each instantiated on a cache miss), and the wait
for the result. A decode step (1 token) and a verify pass (``--width`` tokens) at growing
cache offsets, each alone (read before the next is built) and queued (the next dispatched
while this one computes, as a pipelined step is). Random weights of a real shape, in half
precision, with the server's CUDA attention for short queries. Run it once per MLX setting
to compare (each is read once, when MLX starts), e.g.:

  PYTHONPATH=/tmp/site:$PWD/src python3 bench/gpu/pass_dispatch.py --shape demo --out $OUT/d.jsonl
  MLX_MAX_OPS_PER_BUFFER=100 PYTHONPATH=/tmp/site:$PWD/src python3 bench/gpu/pass_dispatch.py ...

Prints, per kind and mode, the median milliseconds of each phase and of the whole step;
appends one JSON line per kind and mode to ``--out``."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, "..", "..", "src"))  # the project's source
sys.path.append(os.path.join(HERE, "src"))  # the kit's copy

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_map  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    # SmolLM2-135M (the demo model) and Llama-3.2-1B; tiny: the script's own test, on a CPU
    "demo": dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                 num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=49152),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512),
}  # fmt: skip


def build(shape: str) -> Any:
    args = llama.ModelArgs(
        model_type="llama", rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
        **SHAPES[shape],
    )  # fmt: skip
    model = llama.Model(args)
    model.update(tree_map(lambda v: (v * 0.02).astype(mx.float16), model.parameters()))
    mx.eval(model.parameters())
    return model


def launch(model: Any, cache: Any, tokens: mx.array) -> tuple[mx.array, float, float]:
    """Build and dispatch one pass; returns its choices and the seconds of each phase."""
    t0 = time.perf_counter()
    logits = model(tokens[None], cache=cache)[0]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    choice = mx.argmax(logprobs, axis=-1)
    t1 = time.perf_counter()
    mx.async_eval(choice, logprobs)
    return choice, t1 - t0, time.perf_counter() - t1


def run(model: Any, width: int, passes: int, queued: bool) -> dict[str, float]:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(1, 301))]), cache=cache))
    builds, dispatches, waits, steps = [], [], [], []
    feed = mx.array([5] * width, dtype=mx.int32)
    pending = None
    last = time.perf_counter()
    for i in range(passes + 1):
        tokens = feed if pending is None else mx.concatenate([pending[-1:], feed[1:]])
        choice, b, d = launch(model, cache, tokens)
        if queued and pending is not None:
            t = time.perf_counter()
            pending.tolist()  # the pass before, read while this one is queued
            w = time.perf_counter() - t
        else:
            t = time.perf_counter()
            choice.tolist()
            w = time.perf_counter() - t
        now = time.perf_counter()
        if i > 0:  # the first builds kernels
            builds.append(b), dispatches.append(d), waits.append(w), steps.append(now - last)
        last = now
        pending = choice if queued else None
    if pending is not None:
        pending.tolist()
    med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {
        "build_ms": med(builds), "dispatch_ms": med(dispatches), "wait_ms": med(waits),
        "step_ms": med(steps), "step_max_ms": 1e3 * max(steps),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="demo", choices=sorted(SHAPES))
    ap.add_argument("--width", type=int, default=9, help="a verify pass's tokens (k + 1)")
    ap.add_argument("--passes", type=int, default=60)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from mlx_server.models import cuda_attention

    cuda_attention.install()
    env = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    model = build(a.shape)
    print(f"mlx {mx.__version__} {mx.default_device()} shape {a.shape} env {env or 'default'}")
    for width in (1, a.width):
        run(model, width, 8, False)  # warm: kernels for this width
        for queued in (False, True):
            r = run(model, width, a.passes, queued)
            mode = "queued" if queued else "alone"
            print(
                f"  width {width:2d} {mode:6s}: build {r['build_ms']:.2f} dispatch "
                f"{r['dispatch_ms']:.2f} wait {r['wait_ms']:.2f} -> step {r['step_ms']:.2f} ms "
                f"(max {r['step_max_ms']:.1f})"
            )
            if a.out:
                with open(a.out, "a") as f:
                    row = {"scenario": "pass_dispatch", "shape": a.shape, "env": env}
                    f.write(json.dumps({**row, "width": width, "mode": mode, **r}) + "\n")


if __name__ == "__main__":
    main()
