"""The HTTP side's CPU per streamed token: our app behind uvicorn, real streaming clients
(httpx, or the ``openai`` SDK), around the real ``Engine`` driving a paced stand-in model.

Each server is ``bench/http_overhead.py --serve``: the ``Engine`` with a ``PacedRunner`` that
sleeps ``--step-ms`` per step (the interpreter lock free, as while the GPU computes) and
gives every sequence one token of real text, with no Python of its own by default
(``--python-ms 0``), so what the server's CPU spends is ours: the engine thread's delivery
(detokenizer, stop strings, hand-off) and the event loop's (output parsers, encoder, SSE
framing, keep-alive, uvicorn, socket writes). Before and after each burst the bench asks the
server (``GET /bench/cpu``, on the event loop) for its process CPU time and its event-loop
thread's CPU time; per delivered token (the usage the stream reports):

- ``cpu_us``: the whole server process (user + system), both threads;
- ``loop_us``: the event loop's thread alone (the HTTP side proper).

With ``--base SRC``, a second server runs another source tree (``PYTHONPATH=SRC``) beside
this tree's; bursts alternate between the two (the order turning each round) so that a
shared machine's noise falls on both, and the table gives this tree against the base.

    .venv/bin/python bench/http_side.py --base /tmp/base/src --steps 1,5 --ns 1,8,32
    .venv/bin/python bench/http_side.py --client openai --ns 8 --reps 2

The first round of each server is a warm-up and is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_procs import free_port, make_env  # noqa: E402
from http_burst import body, summarize  # noqa: E402
from http_overhead import TOKENIZER, wait_ready  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONTENT = re.compile(r'"content": ?"[^"]')  # a chunk with text
OVERHEAD = str(Path(__file__).resolve().parent / "http_overhead.py")


def start_server(
    src: str, step_ms: float, a: argparse.Namespace
) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    argv = ["--serve", "--port", str(port), "--tokenizer", a.tokenizer, "--n", str(max(a.ns)),
            "--step-ms", str(step_ms), "--python-ms", str(a.python_ms), "--prefill-ms", "0",
            "--new-shape-ms", "0", "--gather-ms", str(a.gather_ms)]  # fmt: skip
    env = make_env(False)
    env["PYTHONPATH"] = src
    proc = subprocess.Popen([sys.executable, OVERHEAD, *argv], env=env, stdout=subprocess.DEVNULL)
    wait_ready(port, proc)
    return proc, port


async def httpx_one(
    client: httpx.AsyncClient, port: int, payload: dict[str, Any]
) -> tuple[float, float, int, int]:
    t_first = t_last = 0.0
    tokens = chunks = 0
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    async with client.stream("POST", url, json=payload) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if '"usage"' in line:
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = int(usage["completion_tokens"])
            if CONTENT.search(line):
                chunks += 1
                t_last = time.perf_counter()
                t_first = t_first or t_last
    return t_first, t_last, tokens, chunks


async def openai_one(client: Any, payload: dict[str, Any]) -> tuple[float, float, int, int]:
    t_first = t_last = 0.0
    tokens = chunks = 0
    stream = await client.chat.completions.create(
        model=payload["model"],
        messages=payload["messages"],
        max_tokens=payload["max_tokens"],
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            t_last = time.perf_counter()
            t_first = t_first or t_last
    return t_first, t_last, tokens, chunks


async def burst(port: int, rep: int, n: int, tokens: int, client_kind: str) -> dict[str, Any]:
    payloads = [body(rep, i, tokens) for i in range(n)]
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        if client_kind == "openai":
            from openai import AsyncOpenAI

            client = AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, http_client=http
            )
            runs = await asyncio.gather(*[openai_one(client, p) for p in payloads])
        else:
            runs = await asyncio.gather(*[httpx_one(http, port, p) for p in payloads])
    out = summarize(t0, [r[:3] for r in runs])
    out["chunks"] = sum(r[3] for r in runs)  # content chunks: fewer than tokens once merged
    return out


def server_cpu(port: int) -> dict[str, float]:
    return dict(httpx.get(f"http://127.0.0.1:{port}/bench/cpu", timeout=30).json())


def measure(port: int, rep: int, n: int, a: argparse.Namespace) -> dict[str, Any]:
    c0 = server_cpu(port)
    r = asyncio.run(burst(port, rep, n, a.tokens, a.client))
    c1 = server_cpu(port)
    per = 1e6 / max(r["tokens"], 1)
    return {
        "tok_s": r["aggregate_tok_s"],
        "cpu_us": (c1["process_s"] - c0["process_s"]) * per,
        "loop_us": (c1["loop_s"] - c0["loop_s"]) * per,
        "tokens": r["tokens"],
        "tokens_per_chunk": r["tokens"] / max(r["chunks"], 1),
        "ttft_p50_s": r["ttft_p50_s"],
    }


def report(rows: list[dict[str, Any]], trees: list[str]) -> None:
    cases = sorted({(r["step_ms"], r["n"]) for r in rows})
    head = f"{'step ms':>7} {'N':>3}"
    for t in trees:
        head += f" | {t + ' tok/s':>11} {'cpu µs/tok':>10} {'loop µs/tok':>11} {'tok/chunk':>9}"
    if len(trees) == 2:
        head += f" | {'tok/s ratio':>11} {'cpu ratio':>9} {'loop ratio':>10}"
    print("\n" + head)
    for step, n in cases:
        line = f"{step:>7g} {n:>3}"
        med: dict[str, dict[str, float]] = {}
        for t in trees:
            rs = [r for r in rows if (r["step_ms"], r["n"], r["tree"]) == (step, n, t)]
            keys = ("tok_s", "cpu_us", "loop_us", "tokens_per_chunk")
            med[t] = {k: statistics.median(r[k] for r in rs) for k in keys}
            m = med[t]
            line += (
                f" | {m['tok_s']:>11.0f} {m['cpu_us']:>10.1f} {m['loop_us']:>11.1f}"
                f" {m['tokens_per_chunk']:>9.2f}"
            )
        if len(trees) == 2:
            b, o = med[trees[0]], med[trees[1]]
            line += (
                f" | {o['tok_s'] / b['tok_s']:>11.2f} {o['cpu_us'] / b['cpu_us']:>9.2f}"
                f" {o['loop_us'] / b['loop_us']:>10.2f}"
            )
        print(line)
    if len(trees) == 2:
        print(f"(ratios: {trees[1]} / {trees[0]}; medians over the counted rounds)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="", help="another checkout's src, measured beside this one")
    p.add_argument("--steps", default="1,5", help="device time per step, ms (comma-separated)")
    p.add_argument("--ns", default="1,8,32", help="streams at once (comma-separated)")
    p.add_argument("--tokens", type=int, default=256, help="generated per request")
    p.add_argument("--reps", type=int, default=3, help="counted rounds (one warm-up more)")
    p.add_argument("--client", choices=("httpx", "openai"), default="httpx")
    p.add_argument("--python-ms", type=float, default=0.0, help="stand-in's own Python per step")
    p.add_argument("--gather-ms", type=float, default=50.0, help="the engine's gather_s")
    p.add_argument("--tokenizer", default=TOKENIZER)
    p.add_argument("--json", default="", help="append one JSON line per counted burst here")
    a = p.parse_args()
    a.ns = [int(x) for x in a.ns.split(",")]
    trees = {"this": str(ROOT / "src")}
    if a.base:
        trees = {"base": str(Path(a.base).resolve()), **trees}
    names = list(trees)
    rows: list[dict[str, Any]] = []
    for step in [float(x) for x in a.steps.split(",")]:
        servers = {name: start_server(src, step, a) for name, src in trees.items()}
        try:
            for rep in range(a.reps + 1):
                for n in a.ns:
                    turn = (rep + a.ns.index(n)) % len(names)
                    for name in names[turn:] + names[:turn]:
                        r = measure(servers[name][1], rep, n, a)
                        row = {"tree": name, "step_ms": step, "n": n, "rep": rep, "client": a.client,
                               **{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}}  # fmt: skip
                        print(json.dumps(row), flush=True)
                        if rep == 0:
                            continue  # warm-up
                        rows.append(row)
                        if a.json:
                            with open(a.json, "a") as f:
                                f.write(json.dumps({**row, "src": trees[name]}) + "\n")
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    report(rows, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
