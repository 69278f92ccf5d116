#!/usr/bin/env python3
"""'No server overhead' reference: mlx_lm.stream_generate in-process.

Uses the same chat-templated prompt as bench_openai.py's `single` scenario
(LONG_PROMPT, greedy, max_tokens 128) and, for prefill, the same ~1000-token
system prompt as its `prefix` scenario. Prints one JSON line.

  $VENV/bin/python raw_engine.py --model MODEL_DIR --label 4bit
  (prefix with LD_PRELOAD=.../libopenblas.so.0 for the OpenBLAS variant)

Figures:
  decode_tok_s    mlx_lm's own generation_tps (tokens after the first / time)
  prefill_tok_s   mlx_lm's own prompt_tps on the ~1000-token prompt
  wall_*          the same measured here with time.perf_counter around the
                  generator (first token latency, decode rate between tokens)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from bench_openai import LONG_PROMPT, make_system_prompt  # noqa: E402
from mlx_lm import load, stream_generate  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402


def run_once(
    model, tok, prompt_ids, max_tokens, logits_processors=None, sampler=None, on_token=None
):
    """One timed stream; ``on_token(resp)`` does a variant's own work on each token (a true
    return ends the stream there, as a matched stop string does)."""
    t0 = time.perf_counter()
    t_first = t_last = None
    last = None
    n = 0
    for resp in stream_generate(
        model,
        tok,
        prompt_ids,
        max_tokens=max_tokens,
        sampler=sampler or make_sampler(temp=0.0),
        logits_processors=logits_processors,
    ):
        done = on_token is not None and on_token(resp)  # timed with the token
        now = time.perf_counter()
        if t_first is None:
            t_first = now
        t_last = now
        n += 1
        last = resp
        if done:
            break
    return {
        "prompt_tokens": last.prompt_tokens,
        "generation_tokens": last.generation_tokens,
        "prompt_tps": last.prompt_tps,
        "generation_tps": last.generation_tps,
        "finish_reason": last.finish_reason,
        "peak_memory_gb": last.peak_memory,
        "wall_ttft_s": t_first - t0,
        "wall_decode_tok_s": (n - 1) / (t_last - t_first) if n > 1 and t_last > t_first else None,
        "wall_total_s": time.perf_counter() - t0,
    }


def eos_sampler(tok, sampler=None):
    """The sampler a request with ``ignore_eos`` gets in the server: ``sampler`` (greedy by
    default) that never picks an EOS id, by one row added to the log-probabilities (the
    server's own ``ban_tokens`` where importable, else an equivalent)."""
    eos = sorted(int(t) for t in tok.eos_token_ids)
    sampler = sampler or make_sampler(temp=0.0)
    try:
        from mlx_server.engine.sampling.samplers import ban_tokens

        ban = ban_tokens(eos)
    except ImportError:
        rows = {}

        def ban(logprobs):
            key = (logprobs.shape[-1], logprobs.dtype)
            if key not in rows:
                row = mx.zeros((key[0],), dtype=key[1])
                row[mx.array(eos)] = -float("inf")
                rows[key] = row
            return logprobs + rows[key]

    return lambda logprobs: sampler(ban(logprobs))


def baseline(model, tok, max_tokens, repeats, ignore_eos, sampler=None, processors=None):
    """One stream of stream_generate on the kit's single-stream prompt (LONG_PROMPT,
    chat-templated): one 16-token warm-up, then ``repeats`` timed runs. The one baseline
    every script of the kit uses. Returns the medians and every run's figures."""
    ids = tok.apply_chat_template(
        [{"role": "user", "content": LONG_PROMPT}], add_generation_prompt=True
    )
    lp = list(processors or [])
    if ignore_eos:
        sampler = eos_sampler(tok, sampler)
    run_once(model, tok, ids, 16, lp or None, sampler)
    runs = [run_once(model, tok, ids, max_tokens, lp or None, sampler) for _ in range(repeats)]
    md = lambda xs: statistics.median([x for x in xs if x is not None])  # noqa: E731
    return {
        "prompt_tokens": runs[0]["prompt_tokens"],
        "decode_tok_s": md([r["generation_tps"] for r in runs]),
        "decode_tok_s_all": [r["generation_tps"] for r in runs],
        "wall_decode_tok_s": md([r["wall_decode_tok_s"] for r in runs]),
        "ttft_s": md([r["wall_ttft_s"] for r in runs]),
        "tokens": [r["generation_tokens"] for r in runs],
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--label", default="")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-repeats", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="never sample an EOS token, as the server's ignore_eos does",
    )
    p.add_argument("--out", default=None)
    a = p.parse_args()

    t0 = time.perf_counter()
    model, tok = load(a.model)
    load_s = time.perf_counter() - t0

    msgs = [{"role": "user", "content": LONG_PROMPT}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    sys_prompt = make_system_prompt(a.system_tokens)
    long_msgs = [
        {"role": "system", "content": "Session 00000000.\n" + sys_prompt},
        {"role": "user", "content": "Which rule mentions a refund? Answer briefly."},
    ]
    long_ids = tok.apply_chat_template(long_msgs, add_generation_prompt=True)

    sampler = eos_sampler(tok) if a.ignore_eos else None
    run_once(model, tok, ids, 16, None, sampler)  # warm-up, as baseline() does
    dec = [run_once(model, tok, ids, a.max_tokens, None, sampler) for _ in range(a.repeats)]
    pre = [run_once(model, tok, long_ids, 1) for _ in range(a.prefill_repeats)]

    md = lambda xs: statistics.median([x for x in xs if x is not None])  # noqa: E731
    out = {
        "scenario": "raw_engine",
        "label": a.label,
        "model": a.model,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_s": load_s,
        "decode_prompt_tokens": dec[0]["prompt_tokens"],
        "decode_tok_s_median": md([d["generation_tps"] for d in dec]),
        "decode_tok_s_all": [d["generation_tps"] for d in dec],
        "wall_decode_tok_s_median": md([d["wall_decode_tok_s"] for d in dec]),
        "wall_ttft_short_prompt_s_median": md([d["wall_ttft_s"] for d in dec]),
        "generation_tokens": [d["generation_tokens"] for d in dec],
        "finish_reasons": [d["finish_reason"] for d in dec],
        "prefill_prompt_tokens": pre[0]["prompt_tokens"],
        "prefill_tok_s_median": md([d["prompt_tps"] for d in pre]),
        "prefill_tok_s_all": [d["prompt_tps"] for d in pre],
        "wall_ttft_long_prompt_s_median": md([d["wall_ttft_s"] for d in pre]),
        "peak_memory_gb": max(d["peak_memory_gb"] for d in dec + pre),
        "ignore_eos": a.ignore_eos,
    }
    out = {
        k: (
            round(v, 4)
            if isinstance(v, float)
            else [round(x, 4) if isinstance(x, float) else x for x in v]
            if isinstance(v, list)
            else v
        )
        for k, v in out.items()
    }
    line = json.dumps(out, separators=(",", ":"))
    print(line, flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
