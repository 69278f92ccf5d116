"""Quality and memory of the quantized KV cache (``--kv-bits``) on the demo model.

Perplexity of a fixed text (this repository's README.md, its first ``--tokens`` tokens) read
in chunks through the model's KV cache, so every chunk attends to the cached (quantized)
keys and values of the ones before it; and the KV bytes per token the cache holds, next to
the estimate admission uses.

The model computes in float32 (float16 matmuls are very slow on Linux CPU); "16" stores the
KV cache in float16 (rounded on store, as a float16 model's cache is), "32" in float32. The
memory figures for 16-bit activations (``kv16_bytes_per_token``: a float16 model's cache,
whose quantization scales are float16 too) are the estimate admission uses, which
tests/process/test_kv_quant.py checks against real caches.

    .venv/bin/python bench/kv_quant.py                  # 16,8,4 on 2,048 tokens
    .venv/bin/python bench/kv_quant.py --bits 32,16,8,4 --tokens 1024
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


class Float16KVCache:
    """A float32 model's KV cache stored in float16."""

    def __new__(cls):  # a KVCache whose stores round to float16
        from mlx_lm.models.cache import KVCache

        class _F16(KVCache):
            def update_and_fetch(self, keys, values):
                k, v = super().update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))
                return k.astype(keys.dtype), v.astype(values.dtype)

        return _F16()


def perplexity(model, tokens: list[int], bits: int, group: int, chunk: int):
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_server.engine.cache.kv_quant import QuantizedKVModel

    if bits == 16:
        cache = [Float16KVCache() for _ in model.layers]
    else:
        cache = make_prompt_cache(QuantizedKVModel(model, bits, group) if bits < 16 else model)
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
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct-f32"))
    ap.add_argument("--bits", default="16,8,4", help="32 and 16: unquantized float KV")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()

    from mlx_lm import load

    from mlx_server.models.loader import kv_bytes_per_token

    model, tokenizer, config = load(args.model, return_config=True)  # type: ignore[misc]
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    text = (ROOT / "README.md").read_text()
    tokens = list(tokenizer.encode(text))[: args.tokens]
    print(
        f"model {Path(args.model).name}, float32 compute, {len(tokens)} tokens of "
        f"README.md (sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]}), chunks of {args.chunk}"
    )
    rows = []
    for b in (int(x) for x in args.bits.split(",")):
        ppl, per_token, secs = perplexity(model, tokens, b, args.group_size, args.chunk)
        q = b if b < 16 else None
        kv16 = kv_bytes_per_token(config, 2, q, args.group_size) if b != 32 else None
        rows.append(
            {
                "bits": b,
                "ppl": ppl,
                "kv_bytes_per_token": per_token,
                "kv16_bytes_per_token": kv16,
                "s": secs,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    print(
        f"\n| KV | perplexity | vs {base['bits']}-bit | KV bytes/token here | "
        "KV bytes/token, 16-bit model | vs 16-bit |"
    )
    print("|---|---|---|---|---|---|")
    ref = next((r["kv16_bytes_per_token"] for r in rows if r["bits"] == 16), None)
    for r in rows:
        m16 = r["kv16_bytes_per_token"]
        ratio = f"{m16 / ref:.3f}" if m16 and ref else "-"
        print(
            f"| {r['bits']}-bit | {r['ppl']:.3f} | {100 * (r['ppl'] / base['ppl'] - 1):+.2f} % | "
            f"{r['kv_bytes_per_token']:.0f} | {m16 or '-'} | {ratio} |"
        )


if __name__ == "__main__":
    main()
