#!/usr/bin/env python3
"""One stream per request variant, over HTTP against the raw engine doing the same work.

Variants: greedy; temperature 0.7 with top_p 0.95; logprobs with top_logprobs 5; ignore_eos;
a stop string. The raw counterpart of each is ``raw_engine.run_once`` (``mlx_lm.stream_generate``, the
same call layers.py and raw_engine.py time the raw engine with) in this process with the
same sampler (for ``ignore_eos``, the server's own: EOS ids banned in the sampler), taking
the top 5 log-probabilities of each token for ``logprobs`` and matching the stop string in
the detokenized text for ``stop``. The server runs at --base-url and is idle while the raw
engine runs.

Order: one warm-up of every variant on both sides, then --repeats rounds; each round runs
every variant once on each side (raw, then the server; the next round the server first), and
the variants' order turns by one each round, so each variant runs at a different position
in each round: an effect of the server's state after the earlier variants (or of the
device warming) shows as a spread across rounds rather than as a cost of one variant. Each
variant's line gives both sides' rates per round with their position, the median, the
spread (min-max) of the rates and of the per-round ratios.

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
from mlx_lm import load  # noqa: E402
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
    """The raw side: ``raw_engine.run_once`` (the call layers.py and raw_engine.py time the
    raw engine with), plus the variant's own work on each token."""
    if work == "ignore_eos":
        sampler = raw_engine.eos_sampler(tok, sampler)
    text: list[str] = []

    def top5(resp: Any) -> bool:
        top = mx.argpartition(-resp.logprobs, 5)[:5]
        _ = (top.tolist(), resp.logprobs[top].tolist())
        return False

    def stop(resp: Any) -> bool:
        text.append(resp.text)
        return STOP in "".join(text[-8:])

    on_token = {"top5": top5, "stop": stop}.get(work)
    r = raw_engine.run_once(model, tok, ids, max_tokens, sampler=sampler, on_token=on_token)
    return {
        "tokens": r["generation_tokens"],
        "ttft_s": r["wall_ttft_s"],
        "decode_tok_s": r["wall_decode_tok_s"],
    }


def spread(xs: list[float | None]) -> dict[str, Any]:
    v = [x for x in xs if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "all": xs}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v}


async def ours_once(args: argparse.Namespace, fields: dict[str, Any]) -> dict:
    b = Bench(parse_args(["--base-url", args.base_url, "--model", args.server_model]))
    b.send_ignore_eos = False  # the variant says
    try:
        msgs = [{"role": "user", "content": LONG_PROMPT}]
        r = await b.stream_chat(msgs, args.max_tokens, extra=dict(fields))
        if not r["ok"] and not ended_at_once(r):
            raise SystemExit(f"request failed: {r.get('error')}")
        r.setdefault("ttft_s", None)
        r.setdefault("decode_tok_s", None)  # none where the model ended at once
        return r
    finally:
        await b.close()


def ended_at_once(r: dict[str, Any]) -> bool:
    """A stream the model ended before any text (its first token an end of sequence, as a
    random-weight model's may be where EOS is not banned): a run without a rate, not a
    failure; the round's ratio is left out."""
    return r.get("finish_reason") == "stop" and not r.get("server_error")


def rounds(names: list[str], repeats: int) -> list[list[str]]:
    """The variants' order in each round: turned by one each round."""
    return [names[i % len(names) :] + names[: i % len(names)] for i in range(repeats)]


def measure(a: argparse.Namespace, names: list[str], model: Any, tok: Any) -> dict[str, list]:
    """Per variant, one entry per round: (position, raw run, our run)."""
    ids = tok.apply_chat_template(
        [{"role": "user", "content": LONG_PROMPT}], add_generation_prompt=True
    )
    samplers = {n: make_sampler(**VARIANTS[n][1]) for n in names}
    for name in names:  # warm-up: kernels for every variant's shapes, both sides
        raw_run(model, tok, ids, 16, samplers[name], VARIANTS[name][2])
        asyncio.run(ours_once(a, VARIANTS[name][0]))
    runs: dict[str, list] = {n: [] for n in names}
    for i, order in enumerate(rounds(names, a.repeats)):
        for pos, name in enumerate(order):
            fields, _, work = VARIANTS[name]
            raw_first = i % 2 == 0
            if raw_first:
                raw = raw_run(model, tok, ids, a.max_tokens, samplers[name], work)
            srv = asyncio.run(ours_once(a, fields))
            if not raw_first:
                raw = raw_run(model, tok, ids, a.max_tokens, samplers[name], work)
            runs[name].append((pos, raw, srv))
    return runs


def variant_row(a: argparse.Namespace, name: str, runs: list) -> dict[str, Any]:
    raws = [r["decode_tok_s"] for _, r, _ in runs]
    ours = [o["decode_tok_s"] for _, _, o in runs]
    r_raw, r_ours = spread(raws), spread(ours)
    ratios = [o / r if o and r else None for o, r in zip(ours, raws, strict=True)]
    return {
        "scenario": "variants",
        "label": a.label,
        "variant": name,
        "max_tokens": a.max_tokens,
        "raw_decode_tok_s": r_raw,
        "ours_decode_tok_s": r_ours,
        "ratio_median": (r_ours["median"] / r_raw["median"])
        if r_ours["median"] and r_raw["median"]
        else None,
        "ratio_per_round": spread(ratios),
        "rounds": [
            {"round": i, "position": pos, "raw": r["decode_tok_s"], "ours": o["decode_tok_s"]}
            for i, (pos, r, o) in enumerate(runs)
        ],
        "raw_tokens": [r["tokens"] for _, r, _ in runs],
        "ours_tokens": [o["completion_tokens"] for _, _, o in runs],
        "raw_ttft_s": spread([r["ttft_s"] for _, r, _ in runs])["median"],
        "ours_ttft_s": spread([o["ttft_s"] for _, _, o in runs])["median"],
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--base-url", required=True)
    p.add_argument("--server-model", default="m")
    p.add_argument("--label", default="")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5, help="rounds over every variant")
    p.add_argument("--only", default="", help="comma list of variants (default: all)")
    p.add_argument("--out")
    a = p.parse_args()
    names = [n for n in VARIANTS if not a.only or n in a.only.split(",")]
    model, tok = load(a.model)
    runs = measure(a, names, model, tok)
    for name in names:
        line = json.dumps(rnd(variant_row(a, name, runs[name])), separators=(",", ":"))
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
