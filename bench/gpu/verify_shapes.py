#!/usr/bin/env python3
"""Do new cache offsets cost a kernel build on CUDA? One decode step (1 token) and one
speculative verify pass (k+1 tokens) in turn, each at an offset the cache has not been at,
at batch 1 (mlx-lm's make_prompt_cache) and batch B (the batch caches BatchGenerator merges).
The same sequence runs twice in one process: round 1 meets every shape for the first time,
round 2 meets them again, so a pass much slower in round 1 than in round 2 is a build, not work.

  PYTHONPATH=/tmp/site:$PWD/src python3 bench/gpu/verify_shapes.py --model /tmp/models/qwen35-9b-4 \\
      --out $OUT/verify_shapes.jsonl

Prints every pass's time, then per batch and kind the medians and the passes over 2x the
round-2 median; appends JSON lines to --out (scenario "verify_shapes"). ``--gdn-kernel``
(default on) installs the CUDA gated-delta kernel first, as the server does on a CUDA GPU."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, "..", "..", "src"))  # the project's source, if not on PYTHONPATH
sys.path.append(os.path.join(HERE, "src"))  # the kit's copy (/tmp/kit/a/src)

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

OUT: str | None = None
LABEL = ""
KERNEL = False  # whether the CUDA gated-delta kernel is in place (every row says)


def emit(**row: Any) -> None:
    row = {"scenario": "verify_shapes", "label": LABEL, "gdn_kernel": KERNEL, **row}
    row = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}
    if OUT:
        with open(OUT, "a") as f:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


def batch_cache(model: Any, batch: int) -> list[Any]:
    """Batch 1: the lone path's cache. More: each layer's batch cache, merged from empty
    per-sequence caches as BatchGenerator does (BatchKVCache, ArraysCache with padding...)."""
    if batch == 1:
        return make_prompt_cache(model)
    caches = [make_prompt_cache(model) for _ in range(batch)]
    merged = []
    for i, layer in enumerate(caches[0]):
        if not hasattr(layer, "merge"):
            raise SystemExit(f"{type(layer).__name__} has no batch form")
        merged.append(layer.merge([c[i] for c in caches]))
    return merged


def cache_arrays(cache: list[Any]) -> list[mx.array]:
    return [a for c in cache for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]


def one_pass(model: Any, cache: list[Any], tokens: mx.array) -> float:
    """Seconds for a forward pass over ``tokens`` that extends ``cache``, evaluated."""
    t0 = time.perf_counter()
    logits = model(tokens, cache=cache)
    mx.eval(logits, cache_arrays(cache))
    return time.perf_counter() - t0


def run_round(model: Any, vocab: int, batch: int, args: Any, rnd: int) -> dict[str, list[float]]:
    """Prefill, then ``args.passes`` (decode, verify) pairs; returns seconds per kind."""
    key = mx.random.key(batch)  # the same tokens in both rounds: the same shapes
    cache = batch_cache(model, batch)
    prompt = mx.random.randint(0, vocab, (batch, args.prompt_tokens), key=key)
    t_prefill = one_pass(model, cache, prompt)
    offset = args.prompt_tokens
    print(
        f"batch {batch} round {rnd}: prefill {args.prompt_tokens} tokens {t_prefill * 1000:.1f} ms"
    )
    emit(batch=batch, round=rnd, kind="prefill", offset=0, tokens=args.prompt_tokens,
         ms=t_prefill * 1000)  # fmt: skip
    times: dict[str, list[float]] = {"decode": [], "verify": []}
    width = {"decode": 1, "verify": args.k + 1}
    for i in range(args.passes):
        line = []
        for kind in ("decode", "verify"):
            n = width[kind]
            toks = mx.random.randint(
                0, vocab, (batch, n), key=mx.random.key(1000 * batch + 2 * i + n)
            )
            dt = one_pass(model, cache, toks)
            times[kind].append(dt)
            emit(batch=batch, round=rnd, kind=kind, offset=offset, tokens=n, ms=dt * 1000)
            line.append(f"{kind} @{offset} {dt * 1000:7.2f} ms")
            offset += n
        print("  " + "   ".join(line))
    return times


def long_prefill(model: Any, vocab: int, n: int, chunk: int = 2048) -> None:
    """One batch-1 prompt of ``n`` random tokens, ``chunk`` at a time, as the server does."""
    cache = make_prompt_cache(model)
    tokens = mx.random.randint(0, vocab, (1, n), key=mx.random.key(5))
    t0 = time.perf_counter()
    for start in range(0, n, chunk):
        one_pass(model, cache, tokens[:, start : start + chunk])
    dt = time.perf_counter() - t0
    print(f"long prompt: {n} tokens prefilled in {dt:.2f} s ({n / dt:.0f} tok/s)")
    emit(kind="long_prefill", tokens=n, chunk=chunk, s=dt)


def summarize(batch: int, rounds: list[dict[str, list[float]]]) -> None:
    for kind in ("decode", "verify"):
        cold, warm = rounds[0][kind], rounds[-1][kind]
        ref = statistics.median(warm)
        spikes = [(i, round(t * 1000, 1)) for i, t in enumerate(cold) if t > 2 * ref]
        print(
            f"batch {batch} {kind:6}: round 1 median {statistics.median(cold) * 1000:.2f} ms "
            f"(max {max(cold) * 1000:.1f}), round {len(rounds)} median {ref * 1000:.2f} ms "
            f"(max {max(warm) * 1000:.1f}); round-1 passes over 2x: {spikes or 'none'}"
        )
        emit(batch=batch, kind=kind, what="summary", cold_median_ms=statistics.median(cold) * 1000,
             cold_max_ms=max(cold) * 1000, warm_median_ms=ref * 1000, warm_max_ms=max(warm) * 1000,
             cold_spikes=len(spikes), passes=len(cold))  # fmt: skip


def main() -> int:
    global OUT, LABEL, KERNEL
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model directory (mlx-lm's load)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--k", type=int, default=8, help="draft tokens: a verify pass is k+1 wide")
    ap.add_argument("--passes", type=int, default=16, help="(decode, verify) pairs per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gdn-kernel", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--short-attention",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="short queries' attention computed plainly, as the server does on CUDA",
    )
    ap.add_argument("--long-prompt", type=int, default=0,
                    help="first time one prompt this long, prefilled in 2048-token chunks")  # fmt: skip
    ap.add_argument("--label", default="")
    ap.add_argument("--out")
    args = ap.parse_args()
    OUT, LABEL = args.out, args.label or os.path.basename(args.model.rstrip("/"))
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"no model at {args.model} (config.json missing)")
        return 2

    model, _tok, config = load(args.model, return_config=True)  # type: ignore[misc]
    print(f"mlx {mx.__version__}, {mx.default_device()}; {args.model}")
    if args.gdn_kernel:
        from mlx_server.models.gated_delta_cuda import install

        print(
            f"gated-delta kernel: {install(model) or 'not installed (not CUDA, or no such layers)'}"
        )
    if args.short_attention:
        from mlx_server.models.cuda_attention import install as install_attention

        print(f"short queries' attention: {install_attention() or 'not installed (not CUDA)'}")
    text = config.get("text_config", config)
    vocab = int(text.get("vocab_size") or config["vocab_size"])
    if args.long_prompt:
        long_prefill(model, vocab, args.long_prompt)
    for batch in (int(x) for x in args.batches.split(",") if x):
        rounds = [run_round(model, vocab, batch, args, r + 1) for r in range(args.rounds)]
        summarize(batch, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
