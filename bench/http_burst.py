"""A burst of N streams through each layer: the engine alone, the chat service, and HTTP.

Both sides run in their own process with the same flags and environment (float32 demo model,
OpenBLAS preloaded where installed): a worker process that loads the model the way the server
does (``boot.chat.load_chat_model``) and takes each burst on stdin, and ``python -m mlx_server``.
They take turns, so that the noise of a shared machine falls on both:

- ``engine``: N ``GenerationRequest`` submitted to the ``Engine`` at once, the handles read on
  an asyncio loop (the prompts tokenized as the chat service would, beforehand);
- ``service``: N ``ChatService.start`` at once, reading ``Generation.events()`` (prompt
  rendering in worker threads, output parsers), as the HTTP routes do, without HTTP;
- ``http``: N streamed chat completions sent together to the server, read by a minimal
  client (raw sockets; only the final usage chunk is parsed, so the client's own work stays
  small next to the server's on a machine of two cores).

Every request has ``ignore_eos`` and its own short prompt (nothing but the chat template's
preamble is shared). Aggregate tok/s is all generated tokens over the time from the first
request sent to the last token; TTFT is per request.

    .venv/bin/python bench/http_burst.py --n 32 --max-tokens 64 --reps 3
    .venv/bin/python bench/http_burst.py --n 32 --profile /tmp/burst.txt   # py-spy the server

With ``--profile``, one more HTTP burst runs under ``py-spy record`` (needs py-spy in the
environment and the right to trace the server), and the busiest functions of each of the
server's threads are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from bench_procs import Server, make_env, openblas_path

ROOT = Path(__file__).resolve().parents[1]
F32 = str(ROOT / "models/smollm2-135m-instruct-f32")
CONTENT = re.compile(rb'"content": ?"[^"]')  # a chunk with text
USAGE = re.compile(rb'"usage": ?\{')
TOPICS = ["a lighthouse", "a robot", "Paris", "chess", "Mars", "a dragon", "a sailor", "a cat"]


def body(rep: int, i: int, max_tokens: int) -> dict[str, Any]:
    """Request ``i`` of burst ``rep``: a short prompt of its own, ``ignore_eos``, streamed."""
    topic = TOPICS[i % len(TOPICS)]
    return {
        "model": "m",
        "messages": [{"role": "user", "content": f"[{rep}-{i}] Tell me about {topic}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def summarize(t0: float, runs: list[tuple[float, float, int]]) -> dict[str, Any]:
    """``runs``: (first token time, last token time, tokens) per request."""
    firsts = sorted(r[0] - t0 for r in runs)
    t_end = max(r[1] for r in runs)
    tokens = sum(r[2] for r in runs)
    all_started = t0 + firsts[-1]
    return {
        "aggregate_tok_s": tokens / (t_end - t0),
        "decode_tok_s": (tokens - len(runs)) / (t_end - all_started) if t_end > all_started else 0,
        "ttft_p50_s": statistics.median(firsts),
        "ttft_p95_s": firsts[int(round(0.95 * (len(firsts) - 1)))],
        "ttft_max_s": firsts[-1],
        "tokens": tokens,
        "wall_s": t_end - t0,
    }


# ---- HTTP: a minimal streaming client -------------------------------------------------------


async def http_one(port: int, payload: dict[str, Any]) -> tuple[float, float, int]:
    data = json.dumps(payload).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        "Connection: close\r\n\r\n"
    )
    writer.write(head.encode() + data)
    await writer.drain()
    t_first = t_last = 0.0
    tokens = 0
    buf = b""
    while chunk := await reader.read(1 << 16):
        buf += chunk
        lines = buf.split(b"\n")
        buf = lines.pop()
        for line in lines:
            if not line.startswith(b"data: {"):
                continue
            if CONTENT.search(line):
                t_last = time.perf_counter()
                t_first = t_first or t_last
            if USAGE.search(line):
                tokens = int(json.loads(line[6:])["usage"]["completion_tokens"])
    writer.close()
    return t_first, t_last, tokens


async def http_burst(port: int, rep: int, n: int, max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    runs = await asyncio.gather(*[http_one(port, body(rep, i, max_tokens)) for i in range(n)])
    return summarize(t0, list(runs))


# ---- the engine and the service, in a worker process ---------------------------------------


class Worker:
    """``worker_main`` in a child process with the server's environment."""

    def __init__(self, flags: list[str], openblas: bool):
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__)), "--worker", json.dumps(flags)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=make_env(openblas),
        )
        assert self.proc.stdout is not None
        while not (line := self.proc.stdout.readline()).startswith("ready"):
            if not line:
                raise RuntimeError("the worker exited before it was ready")

    def run(self, layer: str, rep: int, n: int, max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        job = {"layer": layer, "rep": rep, "n": n, "max_tokens": max_tokens}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return dict(json.loads(self.proc.stdout.readline()))

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def worker_main(flags: list[str]) -> None:
    from mlx_server.boot.chat import load_chat_model
    from mlx_server.boot.memory import set_cache_limit
    from mlx_server.cli import parse_settings
    from mlx_server.protocols.openai.chat.adapter import to_chat_request
    from mlx_server.protocols.openai.chat.schemas import ChatCompletionRequest

    out = os.fdopen(os.dup(1), "w")  # results only; the server's log lines go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    settings = parse_settings(flags)
    set_cache_limit(settings)
    parts = load_chat_model(settings)
    service, engine = parts.service, parts.engine
    print("ready", file=out, flush=True)

    def chats(job: dict[str, Any]) -> list[Any]:
        return [
            to_chat_request(
                ChatCompletionRequest.model_validate(body(job["rep"], i, job["max_tokens"]))
            )
            for i in range(job["n"])
        ]

    async def engine_burst(job: dict[str, Any]) -> dict[str, Any]:
        from mlx_server.engine.core.handle import TokenPiece
        from mlx_server.events import Finished

        reqs = [service.build_request(c, f"r{job['rep']}-{i}")[0] for i, c in enumerate(chats(job))]
        loop = asyncio.get_running_loop()

        async def one(req: Any) -> tuple[float, float, int]:
            t_first = t_last = 0.0
            n = 0
            async for ev in engine.submit(req, loop):
                if isinstance(ev, TokenPiece) and ev.text:
                    t_last = time.perf_counter()
                    t_first = t_first or t_last
                elif isinstance(ev, Finished):
                    n = ev.usage.completion_tokens
            return t_first, t_last, n

        t0 = time.perf_counter()
        runs = await asyncio.gather(*[one(r) for r in reqs])
        return summarize(t0, list(runs))

    async def service_burst(job: dict[str, Any]) -> dict[str, Any]:
        from mlx_server.events import Finished

        async def one(chat: Any) -> tuple[float, float, int]:
            gen = await service.start(chat)
            t_first = t_last = 0.0
            n = 0
            async for ev in gen.events():
                if isinstance(ev, Finished):
                    n = ev.usage.completion_tokens
                elif getattr(ev, "text", ""):
                    t_last = time.perf_counter()
                    t_first = t_first or t_last
            return t_first, t_last, n

        todo = chats(job)  # validated beforehand, as the HTTP route's body is before it starts
        t0 = time.perf_counter()
        runs = await asyncio.gather(*[one(c) for c in todo])
        return summarize(t0, list(runs))

    for line in sys.stdin:
        job = json.loads(line)
        burst = engine_burst if job["layer"] == "engine" else service_burst
        print(json.dumps(asyncio.run(burst(job))), file=out, flush=True)
    engine.shutdown()


# ---- py-spy: the busiest functions per thread ------------------------------------------------


def profile_burst(srv: Server, rep: int, n: int, max_tokens: int, out: str) -> None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    assert srv.proc is not None
    rec = subprocess.Popen(
        [
            spy,
            "record",
            "--pid",
            str(srv.proc.pid),
            "--rate",
            "200",
            "--threads",
            "--idle",
            "--format",
            "raw",
            "--output",
            out,
            "--nonblocking",
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # py-spy attaches
    r = asyncio.run(http_burst(srv.port, rep, n, max_tokens))
    rec.send_signal(2)  # SIGINT: py-spy writes what it sampled
    rec.wait(60)
    print(json.dumps({"profiled_http": r}), flush=True)
    print_profile(out)


def print_profile(path: str, top: int = 12) -> None:
    """Per thread: samples, and the functions with the most samples (inclusive, and as the
    innermost frame), from py-spy's collapsed stacks."""
    incl: dict[str, Counter[str]] = defaultdict(Counter)
    self_: dict[str, Counter[str]] = defaultdict(Counter)
    total: Counter[str] = Counter()
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread, frames = frames[0], [f.split(" (")[0] for f in frames[1:]]
        total[thread] += int(count)
        for f in set(frames):
            incl[thread][f] += int(count)
        if frames:
            self_[thread][frames[-1]] += int(count)
    for thread, n in total.most_common():
        print(f"\n{thread}: {n} samples")
        print("  inclusive: " + ", ".join(f"{f} {c}" for f, c in incl[thread].most_common(top)))
        print("  innermost: " + ", ".join(f"{f} {c}" for f, c in self_[thread].most_common(top)))


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker_main(json.loads(sys.argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=F32)
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layers", default="engine,service,http")
    p.add_argument("--no-openblas", action="store_true")
    p.add_argument("--server-args", default="", help="more flags for both sides")
    p.add_argument("--profile", default="", help="py-spy one more HTTP burst into this file")
    p.add_argument("--json", default="", help="append the lines here")
    a = p.parse_args()
    openblas = not a.no_openblas and openblas_path() is not None
    flags = ["-m", a.model, "--model-id", "m", "--ctx-size", "4096", "--max-batch-size",
             str(a.n), "--prompt-cache-dir", "", *a.server_args.split()]  # fmt: skip
    layers = a.layers.split(",")
    print(f"# model {a.model}, N={a.n}, {a.max_tokens} tokens, OpenBLAS: {openblas}", flush=True)
    worker = Worker(flags, openblas) if {"engine", "service"} & set(layers) else None
    srv = Server("ours", a.model, openblas, extra=flags[2:]).start() if "http" in layers else None
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    try:
        for rep in range(a.reps + 1):  # the first is a warm-up, not reported
            order = layers[rep % len(layers) :] + layers[: rep % len(layers)]
            for layer in order:
                if layer == "http":
                    assert srv is not None
                    r = asyncio.run(http_burst(srv.port, rep, a.n, a.max_tokens))
                else:
                    assert worker is not None
                    r = worker.run(layer, rep, a.n, a.max_tokens)
                row = {"layer": layer, "rep": rep, "n": a.n, **r}
                row = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
                print(json.dumps(row), flush=True)
                if rep:
                    rows[layer].append(row)
                    if a.json:
                        with open(a.json, "a") as f:
                            f.write(json.dumps(row) + "\n")
        if a.profile and srv is not None:
            profile_burst(srv, a.reps + 1, a.n, a.max_tokens, a.profile)
    finally:
        if worker is not None:
            worker.stop()
        if srv is not None:
            srv.stop()
    print(f"\n{'layer':8} {'aggregate tok/s (min-max)':>28} {'TTFT p95 s':>11} {'vs engine':>10}")
    base = statistics.median(
        r["aggregate_tok_s"] for r in rows.get("engine", [{"aggregate_tok_s": 0}])
    )
    for layer, rs in rows.items():
        agg = [r["aggregate_tok_s"] for r in rs]
        md = statistics.median(agg)
        ratio = f"{md / base:.2f}" if base else "-"
        p95 = statistics.median(r["ttft_p95_s"] for r in rs)
        print(f"{layer:8} {md:>10.1f} ({min(agg):.1f}-{max(agg):.1f}) {p95:>11.3f} {ratio:>10}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
