"""Quality and memory of the quantized KV cache (``--kv-bits``) on the demo model.

Perplexity of a fixed text (this repository's README.md, its first ``--tokens`` tokens) read
in chunks through the model's KV cache, so every chunk attends to the cached (quantized)
keys and values of the ones before it; and the KV bytes per token the cache holds, next to
the estimate admission uses. Unquantized is the model's activation dtype (``--dtype``).

    .venv/bin/python bench/kv_quant.py                        # float16 activations
    .venv/bin/python bench/kv_quant.py --dtype float32 --bits 32,8,4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

ROOT = Path(__file__).resolve().parents[1]


def kv_nbytes(cache: list, n: int) -> int:
    """Bytes of the cache's arrays for its ``n`` tokens (buffers grow in steps)."""
    total = 0
    for c in cache:
        parts = c.keys + c.values if isinstance(c.keys, tuple) else (c.keys, c.values)
        for x in parts:
            total += x[..., :n, :].nbytes
    return total


def perplexity(model, tokens: list[int], bits: int | None, group: int, chunk: int):
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_server.engine.kv_quant import QuantizedKVModel

    m = QuantizedKVModel(model, bits, group) if bits else model
    cache = make_prompt_cache(m)
    nll, count = 0.0, 0
    t0 = time.perf_counter()
    for start in range(0, len(tokens) - 1, chunk):
        x = mx.array(tokens[start : start + chunk + 1])
        inp, target = x[:-1], x[1:]
        logits = model(inp[None], cache=cache)[0].astype(mx.float32)
        loss = nn.losses.cross_entropy(logits, target, reduction="sum")
        mx.eval(loss)
        nll += loss.item()
        count += target.size  # the cache now holds inp: the next chunk continues after it
    n_cached = cache[0].offset
    return math.exp(nll / count), kv_nbytes(cache, n_cached) / n_cached, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--bits", default="16,8,4", help="16 or 32 means unquantized")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()

    from mlx_lm import load

    from mlx_server.models.loader import kv_bytes_per_token

    model, tokenizer, config = load(args.model, return_config=True)  # type: ignore[misc]
    model.set_dtype(getattr(mx, args.dtype))
    mx.eval(model.parameters())
    text = (ROOT / "README.md").read_text()
    tokens = list(tokenizer.encode(text))[: args.tokens]
    elem = getattr(mx, args.dtype).size
    print(
        f"model {Path(args.model).name}, activations {args.dtype}, {len(tokens)} tokens of "
        f"README.md (sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]}), chunks of {args.chunk}"
    )
    rows = []
    for b in (int(x) for x in args.bits.split(",")):
        bits = b if b < 16 else None
        ppl, per_token, secs = perplexity(model, tokens, bits, args.group_size, args.chunk)
        est = kv_bytes_per_token(config, elem, bits, args.group_size)
        rows.append(
            {"bits": b, "ppl": ppl, "kv_bytes_per_token": per_token, "estimate": est, "s": secs}
        )
        print(json.dumps(rows[-1]))
    base = rows[0]
    print(
        f"\n| KV | perplexity | vs {base['bits']}-bit | KV bytes/token | vs {base['bits']}-bit | estimate |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['bits']}-bit | {r['ppl']:.3f} | {100 * (r['ppl'] / base['ppl'] - 1):+.2f} % | "
            f"{r['kv_bytes_per_token']:.0f} | {r['kv_bytes_per_token'] / base['kv_bytes_per_token']:.3f} | "
            f"{r['estimate']} |"
        )


if __name__ == "__main__":
    main()
