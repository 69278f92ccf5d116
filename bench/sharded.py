"""One process against the same model split across ranks on this machine (``--ranks N``):
the same burst of streams through each, side by side.

Both servers run the float32 demo model (OpenBLAS preloaded where installed) and stay up
for the whole run; their bursts take turns, so that the noise of a shared machine falls on
both. A burst is ``--n`` streamed chat completions sent together, each with its own short
prompt, ``ignore_eos`` and ``--max-tokens``; aggregate tok/s is all generated tokens over
the time from the first request sent to the last token.

    .venv/bin/python bench/sharded.py --n 4 --max-tokens 64 --reps 3
    .venv/bin/python bench/sharded.py --shard tensor --model path/to/model   # heads divisible

On one machine the ranks share its cores and memory bandwidth: this measures what running
in lockstep costs (the journal each step, the hand-over between ranks), not what several
machines gain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from bench_procs import ROOT, Server

F32 = str(ROOT / "models/smollm2-135m-instruct-f32")

TOPICS = ["a lighthouse", "a robot", "Paris", "chess", "Mars", "a dragon", "a sailor", "a cat"]


def stream(base: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed greedy completion of exactly ``max_tokens``: when sent, first and last
    token, and the token count the server reports."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t_send = time.perf_counter()
    t_first = t_last = 0.0
    tokens = 0
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = int(data["usage"]["completion_tokens"])
            if any((c.get("delta") or {}).get("content") for c in data.get("choices") or []):
                t_last = time.perf_counter()
                t_first = t_first or t_last
    return {"t_send": t_send, "ttft": t_first - t_send, "t_last": t_last, "tokens": tokens}


def burst(server: Server, rep: int, n: int, max_tokens: int) -> dict[str, float]:
    def one(i: int) -> dict[str, Any]:
        prompt = f"[{rep}-{i}] Tell me about {TOPICS[i % len(TOPICS)]}."
        return stream(server.base, prompt, max_tokens)

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    start = min(r["t_send"] for r in results)
    end = max(r["t_last"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {
        "tps": tokens / (end - start),
        "ttft": statistics.median(r["ttft"] for r in results),
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=F32)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--shard", default="auto", choices=("auto", "pipeline", "tensor"))
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    servers = {
        "one process": Server("ours", args.model, True),
        f"{args.ranks} ranks": Server(
            "ours", args.model, True, ["--ranks", str(args.ranks), "--shard", args.shard]
        ),
    }
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():  # a first burst each, unmeasured
            burst(s, -1, args.n, 8)
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in servers}
        for rep in range(args.reps):
            for name, s in servers.items():
                runs[name].append(burst(s, rep, args.n, args.max_tokens))
    finally:
        for s in servers.values():
            s.stop()
    print(f"{args.n} streams x {args.max_tokens} tokens, {args.reps} bursts each, median:")
    tps = {}
    for name, rs in runs.items():
        tps[name] = statistics.median(r["tps"] for r in rs)
        ttft = statistics.median(r["ttft"] for r in rs)
        print(f"  {name:>12}: {tps[name]:7.1f} tok/s aggregate, TTFT {ttft * 1000:6.0f} ms")
    one, many = tps["one process"], tps[f"{args.ranks} ranks"]
    print(f"  ranks / one process: {many / one:.2f}x")


if __name__ == "__main__":
    main()
