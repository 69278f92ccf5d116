#!/usr/bin/env python3
"""One stream per request variant, over HTTP against the raw engine doing the same work.

Variants: greedy; temperature 0.7 with top_p 0.95; logprobs with top_logprobs 5; ignore_eos;
a stop string. The raw counterpart of each is ``mlx_lm.stream_generate`` in this process with
the same sampler and logits processors (the server's own EOS mask for ``ignore_eos``), taking
the top 5 log-probabilities of each token for ``logprobs`` and matching the stop string in
the detokenized text for ``stop``. The raw runs come first, then the server (already running
at --base-url, idle meanwhile). Each side: one warm-up, then --repeats timed runs of the same
prompt (the kit's single-stream prompt) and max_tokens; the spread over the runs is reported.

    python3 variants.py --model DIR --base-url http://127.0.0.1:PORT/v1 --label "variants 1b-0" --out r.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mlx.core as mx  # noqa: E402
import raw_engine  # noqa: E402
from bench_openai import LONG_PROMPT, Bench, parse_args, rnd  # noqa: E402
from mlx_lm import load, stream_generate  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

STOP = "\n\nTHE END."  # a stop string the text does not contain: checked, never matched

# name -> (request fields, sampler settings, extra raw work)
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, float], str]] = {
    "greedy": ({"temperature": 0.0}, {"temp": 0.0}, ""),
    "temp0.7_top_p0.95": ({"temperature": 0.7, "top_p": 0.95}, {"temp": 0.7, "top_p": 0.95}, ""),
    "logprobs5": ({"temperature": 0.0, "logprobs": True, "top_logprobs": 5}, {"temp": 0.0}, "top5"),
    "ignore_eos": ({"temperature": 0.0, "ignore_eos": True}, {"temp": 0.0}, "ignore_eos"),
    "stop": ({"temperature": 0.0, "stop": [STOP]}, {"temp": 0.0}, "stop"),
}


def raw_run(model: Any, tok: Any, ids: list[int], max_tokens: int, sampler: Any, work: str) -> dict:
    lp = [raw_engine.eos_ban(tok)] if work == "ignore_eos" else None
    t0 = time.perf_counter()
    t_first = t_last = 0.0
    n = 0
    text = ""
    for resp in stream_generate(
        model, tok, ids, max_tokens=max_tokens, sampler=sampler, logits_processors=lp
    ):
        if work == "top5":
            top = mx.argpartition(-resp.logprobs, 5)[:5]
            _ = (top.tolist(), resp.logprobs[top].tolist())
        elif work == "stop":
            text += resp.text
            if STOP in text:
                break
        t_last = time.perf_counter()
        t_first = t_first or t_last
        n += 1
    return {
        "tokens": n,
        "ttft_s": t_first - t0,
        "decode_tok_s": (n - 1) / (t_last - t_first) if n > 1 and t_last > t_first else None,
    }


def spread(xs: list[float | None]) -> dict[str, Any]:
    v = [x for x in xs if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "all": xs}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v}


async def ours(args: argparse.Namespace, fields: dict[str, Any], repeats: int) -> list[dict]:
    b = Bench(parse_args(["--base-url", args.base_url, "--model", args.server_model]))
    b.send_ignore_eos = False  # the variant says
    try:
        msgs = [{"role": "user", "content": LONG_PROMPT}]
        runs = []
        for i in range(repeats + 1):  # the first is the warm-up
            r = await b.stream_chat(msgs, args.max_tokens, extra=dict(fields))
            if not r["ok"]:
                raise SystemExit(f"request failed: {r.get('error')}")
            if i:
                runs.append(r)
        return runs
    finally:
        await b.close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--base-url", required=True)
    p.add_argument("--server-model", default="m")
    p.add_argument("--label", default="")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default="", help="comma list of variants (default: all)")
    p.add_argument("--out")
    a = p.parse_args()
    names = [n for n in VARIANTS if not a.only or n in a.only.split(",")]
    model, tok = load(a.model)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": LONG_PROMPT}], add_generation_prompt=True
    )
    raw: dict[str, list[dict]] = {}
    for name in names:
        _, settings, work = VARIANTS[name]
        sampler = make_sampler(**settings)
        raw_run(model, tok, ids, 16, sampler, work)  # warm-up
        raw[name] = [
            raw_run(model, tok, ids, a.max_tokens, sampler, work) for _ in range(a.repeats)
        ]
    del model
    mx.clear_cache()
    for name in names:
        runs = asyncio.run(ours(a, VARIANTS[name][0], a.repeats))
        r_raw = spread([r["decode_tok_s"] for r in raw[name]])
        r_ours = spread([r["decode_tok_s"] for r in runs])
        row = {
            "scenario": "variants",
            "label": a.label,
            "variant": name,
            "max_tokens": a.max_tokens,
            "raw_decode_tok_s": r_raw,
            "ours_decode_tok_s": r_ours,
            "ratio_median": (r_ours["median"] / r_raw["median"])
            if r_ours["median"] and r_raw["median"]
            else None,
            "raw_tokens": [r["tokens"] for r in raw[name]],
            "ours_tokens": [r["completion_tokens"] for r in runs],
            "raw_ttft_s": spread([r["ttft_s"] for r in raw[name]])["median"],
            "ours_ttft_s": spread([r["ttft_s"] for r in runs])["median"],
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        line = json.dumps(rnd(row), separators=(",", ":"))
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
