#!/usr/bin/env python3
"""Benchmark client for any OpenAI-compatible chat-completions server.

Dependencies: Python >= 3.9, httpx (asyncio + httpx; nothing else).

Scenarios (select with --scenario, comma separated, or "all" = default):
  single      one stream at a time, fixed long-answer prompt, max_tokens 128,
              temperature 0, repeated --repeats times (median reported):
              TTFT (time to first non-empty content delta) and decode tok/s.
  concurrency N simultaneous streams (N in --concurrency, default 1,2,4,8),
              distinct prompts, --conc-max-tokens each (default 32 to keep
              the default run short): aggregate generated tok/s, p50/p95
              TTFT, and a steady-state rate (content chunks/s while all N
              streams are decoding).
  prefix      multi-turn chat whose history grows (system prompt of
              ~--system-tokens tokens + turns): TTFT per turn. Turn 1 is cold
              (a fresh nonce opens the system prompt), later turns extend a
              prefix the server has seen. Controls: turn 1 re-sent verbatim
              (exact repeat) and, with --prefix-cold-control, the final-turn
              conversation re-sent under a NEW nonce (cold at the same length;
              costs one more cold prefill).
  nonstream   non-streaming request with a short reply: end-to-end latency.
  burst       --burst-n simultaneous streams sent first, before the warm-up request
              (the first burst after the server is ready): TTFT p50/p95 and
              aggregate tok/s. Only meaningful as the first scenario.
  long_ctx    (not in "all") an agent session: a ~--long-system-tokens system
              prompt of rules, then two follow-up turns; TTFT and cached tokens
              per turn.
  constrained (not in "all") response_format json_schema vs free decoding at
              each --concurrency level: aggregate tok/s and their ratio, after one
              unmeasured json_schema request; at each level --constrained-rounds
              interleaved rounds, the median per-round ratio and its spread;
              --constrained-schema essay (counted length) or notes.

Each scenario prints ONE JSON line on stdout (and appends it to --out if
given). Progress notes go to stderr.

Token counting: the client asks for stream_options.include_usage and uses the
final usage.completion_tokens when the server returns it
("token_count_source": "usage"); otherwise it counts SSE chunks that carry
content ("token_count_source": "sse_chunks" -- an approximation: a server may
merge or split tokens across chunks).

ignore_eos: sent as an extra body field unless --no-ignore-eos. Servers that
reject unknown fields (HTTP 4xx) are detected by a probe and the field is then
dropped. "Accepted" does not mean "honoured": every result line reports
"hit_max_tokens" so a short answer is visible. The prompts ask for long
answers so the count stays near max_tokens even where ignore_eos is ignored.

Definitions (all client-side, wall clock, time.perf_counter):
  ttft_s       request sent -> first SSE chunk with non-empty delta.content
  decode_tok_s (completion_tokens - 1) / (t_last_token - t_first_token)
  e2e_tok_s    completion_tokens / (t_end - t_request)
  aggregate_tok_s (concurrency) sum(completion_tokens) /
               (last stream end - first stream start)
  server_cpu_s_per_1k_tok (single, each concurrency level; with --server-pid)
               the server process's CPU seconds (user + system, /proc or ps)
               over the scenario or level, per 1,000 completion tokens

Every request loop is bounded (fixed counts) and every request has a timeout.

Example:
  python bench_openai.py --base-url http://127.0.0.1:8090/v1 --label mlx-4bit --out r.jsonl
  python bench_openai.py --scenario single,nonstream --model my-model --api-key sk-...
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.parse
from typing import Any

try:
    import httpx
except ImportError:  # raw_engine.py imports the prompts without needing httpx
    httpx = None

LONG_PROMPT = (
    "Write a long, detailed essay about the history of lighthouses: how they "
    "were built, how their lamps and lenses evolved, the lives of the keepers, "
    "famous shipwrecks they prevented, and why most are automated today. "
    "Use many paragraphs and do not stop early."
)

TOPICS = [
    "the water cycle",
    "medieval castles",
    "the history of bicycles",
    "how volcanoes form",
    "the invention of the printing press",
    "honeybee colonies",
    "the Silk Road",
    "deep-sea exploration",
    "the first railways",
    "how compilers work",
    "coral reefs",
    "ancient Egyptian pyramids",
    "the life of a tree",
    "weather forecasting",
    "the history of chess",
    "glaciers and ice ages",
]

SHORT_PROMPT = "Reply with exactly one word: OK."

# Vocabulary for the synthetic system prompt (deterministic, seeded).
_WORDS = (
    "account agent archive audit balance batch billing branch buffer cache "
    "channel client cluster commit config contract credit customer dataset "
    "deadline delivery deposit device digest domain draft engine entry event "
    "export feature filter folder format gateway handler header inbox index "
    "invoice issue journal kernel ledger license limit listing locale manifest "
    "market member message metric module notice order owner packet partner "
    "payment pipeline policy portal profile project quota record refund region "
    "release report request review route sample schema session shipment signal "
    "source status storage subscriber summary supplier support table tenant "
    "ticket token track transfer update upload user vendor version voucher "
    "warehouse window worker"
).split()


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], p: float) -> float | None:
    """Percentile with linear interpolation (p in [0, 100])."""
    if not values:
        return None
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    k = (len(v) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def med(values: list[float | None]) -> float | None:
    vals = [x for x in values if x is not None]
    return statistics.median(vals) if vals else None


def rnd(x: Any, nd: int = 4) -> Any:
    if isinstance(x, float):
        return round(x, nd)
    if isinstance(x, list):
        return [rnd(i, nd) for i in x]
    if isinstance(x, dict):
        return {k: rnd(v, nd) for k, v in x.items()}
    return x


def note_error(res: dict, obj: dict) -> None:
    """Keep the message of an error a stream carries (a failure after the 200 went out)."""
    err = obj.get("error")
    if err:
        res["server_error"] = str(err.get("message", err) if isinstance(err, dict) else err)[:300]


def make_system_prompt(approx_tokens: int, seed: int = 1234) -> str:
    """Deterministic policy-manual text of roughly approx_tokens tokens
    (~1.3 tokens per word for BPE vocabularies; verify via usage.prompt_tokens)."""
    rng = random.Random(seed)
    n_words = int(approx_tokens / 1.3)
    lines = [
        "You are a support assistant for an operations team. "
        "Follow the rules of the handbook below when answering."
    ]
    words = 0
    rule = 1
    while words < n_words:
        k = rng.randint(8, 16)
        sent = " ".join(rng.choice(_WORDS) for _ in range(k))
        lines.append(f"Rule {rule}: every {sent}.")
        words += k + 2
        rule += 1
    return "\n".join(lines)


async def _sse_data(r: httpx.Response):
    """The ``data:`` payloads of an SSE response with the time each was read. The bytes are
    split here rather than by httpx's line iterator: at tens of streams of a fast server the
    client's own per-line work would otherwise bound what it measures."""
    buf = b""
    async for raw in r.aiter_raw():
        now = time.perf_counter()
        buf += raw
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):  # not blank lines, SSE comments (keepalives)
                yield line[5:].strip(), now


def parse_ps_time(text: str) -> float:
    """Seconds from ``ps -o time=``: ``[[dd-]hh:]mm:ss[.ss]`` (Linux ``00:01:02``, macOS
    ``1:02.50``)."""
    days, _, clock = text.strip().rpartition("-")
    seconds = 0.0
    for part in clock.split(":"):
        seconds = seconds * 60 + float(part)
    return seconds + (int(days) * 86400 if days else 0)


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def process_cpu_clock(pid: int) -> int | None:
    """The clock of a process's CPU time (``clock_getcpuclockid``: every thread's, to the
    nanosecond), where the system lends it for another process (Linux); else None."""
    try:
        clock = ctypes.c_int()
        if _libc().clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
            return None
        return clock.value
    except (OSError, AttributeError):
        return None


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a process has used so far: its CPU-time clock where
    there is one (nanoseconds: a short span's few milliseconds are not rounded to 0), else
    /proc (Linux, in clock ticks), else ``ps`` (macOS, the BSDs); None if none can tell."""
    clock = process_cpu_clock(pid)
    if clock is not None:
        try:
            return time.clock_gettime(clock)
        except OSError:
            pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    try:
        out = subprocess.run(
            ["ps", "-o", "time=", "-p", str(pid)], capture_output=True, text=True, timeout=10
        )
        return parse_ps_time(out.stdout) if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


class ServerCPU:
    """The server's CPU seconds per 1,000 generated tokens over a span of the bench
    (``--server-pid``); nothing without a PID."""

    def __init__(self, pid: int | None):
        self.pid = pid
        self.start: float | None = None

    def begin(self) -> None:
        self.start = process_cpu_s(self.pid) if self.pid else None

    def per_1k(self, tokens: int) -> float | None:
        if not self.pid or self.start is None or tokens <= 0:
            return None
        now = process_cpu_s(self.pid)
        return None if now is None else (now - self.start) * 1000 / tokens


class Bench:
    def __init__(self, args: argparse.Namespace):
        if httpx is None:
            raise SystemExit("httpx is required: pip install httpx")
        self.args = args
        base = args.base_url.rstrip("/")
        if not base.endswith("/v1") and base.count("/") <= 2:
            base += "/v1"  # bare http://host:port -> OpenAI path
        self.base = base
        headers = {"Content-Type": "application/json"}
        if args.api_key:
            headers["Authorization"] = f"Bearer {args.api_key}"
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(args.timeout, connect=10.0),
            limits=limits,
        )
        self.send_ignore_eos = not args.no_ignore_eos
        self.send_stream_usage = True
        self.notes: list[str] = []
        self.cpu = ServerCPU(args.server_pid)
        self.settled_s: float | None = None  # the wait for the idle-time warm-up (``settle``)

    async def close(self) -> None:
        await self.client.aclose()

    # ------------------------------------------------------------------ probes
    def body(self, messages, max_tokens, stream, temperature=0.0, extra=None):
        b: dict[str, Any] = {
            "model": self.args.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": stream,
        }
        if self.send_ignore_eos:
            b["ignore_eos"] = True
        if stream and self.send_stream_usage:
            b["stream_options"] = {"include_usage": True}
        if extra:
            b.update(extra)
        return b

    async def probe(self) -> None:
        """Detect servers that reject ignore_eos / stream_options (4xx)."""
        msgs = [{"role": "user", "content": SHORT_PROMPT}]
        for _ in range(3):  # bounded: at most drop two fields
            try:
                r = await self.client.post(
                    f"{self.base}/chat/completions",
                    json=self.body(msgs, 4, stream=True),
                )
                status, text = r.status_code, r.text
            except httpx.HTTPError as e:
                raise SystemExit(f"cannot reach {self.base}: {e!r}") from e
            if status < 400:
                break
            low = text.lower()
            if self.send_ignore_eos and ("ignore_eos" in low or "extra" in low):
                self.send_ignore_eos = False
                self.notes.append(f"server rejected ignore_eos (HTTP {status}); not sent")
            elif self.send_stream_usage and ("stream_options" in low or "extra" in low):
                self.send_stream_usage = False
                self.notes.append(f"server rejected stream_options (HTTP {status}); not sent")
            elif self.send_ignore_eos:
                self.send_ignore_eos = False
                self.notes.append(f"probe HTTP {status}; dropping ignore_eos")
            else:
                raise SystemExit(f"probe failed: HTTP {status}: {text[:300]}")
        else:
            raise SystemExit("probe failed after dropping optional fields")
        log(
            f"probe ok: ignore_eos={'sent' if self.send_ignore_eos else 'not sent'}, "
            f"stream_options={'sent' if self.send_stream_usage else 'not sent'}"
        )

    # ---------------------------------------------------------------- requests
    async def stream_chat(self, messages, max_tokens, extra=None) -> dict:
        read = self._raw_stream_chat if self.args.client == "raw" else self._stream_chat
        try:
            return await read(messages, max_tokens, extra)
        except (httpx.HTTPError, OSError, asyncio.IncompleteReadError) as e:
            return {"ok": False, "error": repr(e)}  # a server that drops connections under load

    async def _raw_stream_chat(self, messages, max_tokens, extra=None) -> dict:
        """``_stream_chat`` over a bare socket (HTTP/1.1, one connection per request): the
        client's per-chunk work is a line split and a JSON parse, so that at tens of streams
        it measures the server, not httpx's HTTP parser."""
        url = urllib.parse.urlsplit(self.base)
        data = json.dumps(self.body(messages, max_tokens, stream=True, extra=extra)).encode()
        head = [
            f"POST {url.path}/chat/completions HTTP/1.1",
            f"Host: {url.netloc}",
            "Content-Type: application/json",
            f"Content-Length: {len(data)}",
            "Connection: close",
        ]
        if self.args.api_key:
            head.append(f"Authorization: Bearer {self.args.api_key}")
        res: dict[str, Any] = {"ok": False, "ttft_s": None, "chunks": 0, "usage": None}
        res.update(finish_reason=None, text="", chunk_times=[])
        parts: list[str] = []
        t0 = time.perf_counter()
        t_first = t_last = None
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(url.hostname, url.port or 80), 10
        )
        try:
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
            status_line = await asyncio.wait_for(reader.readline(), self.args.timeout)
            status = int(status_line.split()[1]) if status_line.split()[1:] else 0
            buf = b""
            while chunk := await asyncio.wait_for(reader.read(1 << 16), self.args.timeout):
                now = time.perf_counter()
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue  # headers, chunk sizes, blank lines, keep-alive comments
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    try:
                        obj = json.loads(payload)
                    except json.JSONDecodeError:
                        continue
                    note_error(res, obj)
                    if obj.get("usage"):
                        res["usage"] = obj["usage"]
                    if obj.get("timings"):  # this server's (llama.cpp's) final-chunk timings
                        res["timings"] = obj["timings"]
                    for ch in obj.get("choices") or []:
                        content = (ch.get("delta") or {}).get("content")
                        if content:
                            t_first = t_first or now
                            t_last = now
                            res["chunks"] += 1
                            res["chunk_times"].append(now)
                            parts.append(content)
                        if ch.get("finish_reason"):
                            res["finish_reason"] = ch["finish_reason"]
                            t_last = now if t_first is not None else t_last
        finally:
            writer.close()
        if status >= 400:
            res["error"] = f"HTTP {status}"
            return res
        return self._finish(res, parts, t0, t_first, t_last, status)

    async def _stream_chat(self, messages, max_tokens, extra=None) -> dict:
        body = self.body(messages, max_tokens, stream=True, extra=extra)
        res: dict[str, Any] = {
            "ok": False,
            "ttft_s": None,
            "chunks": 0,
            "usage": None,
            "finish_reason": None,
            "text": "",
            "chunk_times": [],
        }
        parts: list[str] = []
        t0 = time.perf_counter()
        t_first = t_last = None
        async with self.client.stream("POST", f"{self.base}/chat/completions", json=body) as r:
            if r.status_code >= 400:
                res["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return res
            async for line, now in _sse_data(r):
                if line == b"[DONE]":
                    break
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue
                note_error(res, obj)
                if obj.get("usage"):
                    res["usage"] = obj["usage"]
                if obj.get("timings"):
                    res["timings"] = obj["timings"]
                for ch in obj.get("choices") or []:
                    delta = ch.get("delta") or {}
                    content = delta.get("content")
                    if content:
                        if t_first is None:
                            t_first = now
                        t_last = now
                        res["chunks"] += 1
                        res["chunk_times"].append(now)
                        parts.append(content)
                    if ch.get("finish_reason"):
                        res["finish_reason"] = ch["finish_reason"]
                        if t_first is not None:
                            t_last = now
        return self._finish(res, parts, t0, t_first, t_last, r.status_code)

    def _finish(self, res: dict, parts: list[str], t0: float, t_first, t_last, status) -> dict:
        """The figures of one streamed answer, from what its reader collected."""
        t_end = time.perf_counter()
        res["text"] = "".join(parts)
        res["ok"] = t_first is not None
        if not res["ok"]:
            res["error"] = (
                f"stream ended without content (finish_reason="
                f"{res['finish_reason']}, HTTP {status})"
            )
            if res.get("server_error"):
                res["error"] += f": {res['server_error']}"
        usage = res["usage"] or {}
        if usage.get("completion_tokens") is not None:
            n, src = int(usage["completion_tokens"]), "usage"
        else:
            n, src = res["chunks"], "sse_chunks"
        res["completion_tokens"] = n
        res["token_count_source"] = src
        res["prompt_tokens"] = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        res["cached_tokens"] = details.get("cached_tokens")
        res["t_start"], res["t_end"] = t0, t_end
        if t_first is not None:
            res["ttft_s"] = t_first - t0
            dt = (t_last or t_first) - t_first
            res["decode_tok_s"] = (n - 1) / dt if n > 1 and dt > 0 else None
            res["e2e_tok_s"] = n / (t_end - t0)
        return res

    async def nonstream_chat(self, messages, max_tokens) -> dict:
        body = self.body(messages, max_tokens, stream=False)
        body.pop("ignore_eos", None)  # short reply wanted
        t0 = time.perf_counter()
        r = await self.client.post(f"{self.base}/chat/completions", json=body)
        dt = time.perf_counter() - t0
        if r.status_code >= 400:
            return {"ok": False, "latency_s": dt, "error": f"HTTP {r.status_code}: {r.text[:300]}"}
        obj = r.json()
        usage = obj.get("usage") or {}
        ch = (obj.get("choices") or [{}])[0]
        return {
            "ok": True,
            "latency_s": dt,
            "completion_tokens": usage.get("completion_tokens"),
            "prompt_tokens": usage.get("prompt_tokens"),
            "text": ((ch.get("message") or {}).get("content") or "")[:80],
        }

    async def chat_turn(
        self, scenario: str, turn: int, history: list[dict], max_tokens, strict: bool = True
    ) -> dict:
        """One turn of a conversation (numbered from 1): its answer joins ``history``; the
        turn's TTFT and token counts, logged. A failed turn ends the run, or with
        ``strict=False`` comes back as ``{"turn", "error"}`` (a failure is a finding too)."""
        r = await self.stream_chat(list(history), max_tokens)
        if not r["ok"]:
            if strict:
                raise SystemExit(f"{scenario} turn {turn} failed: {r.get('error')}")
            log(f"{scenario} turn {turn} failed: {r.get('error')}")
            return {"turn": turn, "error": r.get("error")}
        history.append({"role": "assistant", "content": r["text"]})
        log(
            f"{scenario} turn {turn}: ttft={r['ttft_s']:.3f}s prompt={r['prompt_tokens']} "
            f"cached={r['cached_tokens']}"
        )
        keys = ("ttft_s", "prompt_tokens", "cached_tokens", "completion_tokens")
        return {"turn": turn, **{k: r[k] for k in keys}}

    def common(self, scenario: str) -> dict:
        return {
            "scenario": scenario,
            "label": self.args.label,
            "base_url": self.base,
            "model": self.args.model,
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "ignore_eos_sent": self.send_ignore_eos,
            "stream_usage_requested": self.send_stream_usage,
            "client": self.args.client,
            "idle_warm_up_wait_s": self.settled_s,
        }

    async def warmup(self) -> None:
        for i in range(self.args.warmup):  # bounded
            r = await self.stream_chat(
                [{"role": "user", "content": f"Warm-up {i}: say hello."}], 16
            )
            if not r["ok"]:
                raise SystemExit(f"warm-up failed: {r.get('error')}")
        log(f"warm-up done ({self.args.warmup} requests)")

    async def settle(self) -> None:
        """Wait, ``--settle-s`` at most, until the server has nothing left for its idle time
        (our ``/health``'s ``warming_up``; a server without it: at once), so that no round
        meets a warm-up piece (on a cold CUDA kernel cache one takes seconds)."""
        root = self.base[: -len("/v1")] if self.base.endswith("/v1") else self.base
        t0 = time.perf_counter()
        while True:
            try:
                r = await self.client.get(root + "/health")
                body = r.json() if r.status_code == 200 else {}
                busy = isinstance(body, dict) and body.get("warming_up") is True
            except (httpx.HTTPError, ValueError):
                busy = False
            waited = time.perf_counter() - t0
            if not busy:
                break
            if waited >= self.args.settle_s:
                self.notes.append(f"still warming up after {waited:.0f}s of waiting")
                break
            await asyncio.sleep(0.1)
        self.settled_s = waited if not busy else None
        state = "still warming up after" if busy else "settled after"
        log(f"idle-time warm-up: {state} {waited:.1f}s")

    # --------------------------------------------------------------- scenarios
    async def sc_single(self) -> dict:
        a = self.args
        runs = []
        self.cpu.begin()
        for i in range(a.repeats):  # bounded
            r = await self.stream_chat([{"role": "user", "content": LONG_PROMPT}], a.max_tokens)
            if not r["ok"]:
                raise SystemExit(f"single run {i} failed: {r.get('error')}")
            runs.append(r)
            log(
                f"single {i + 1}/{a.repeats}: ttft={r['ttft_s']:.3f}s "
                f"decode={r['decode_tok_s'] or 0:.1f} tok/s n={r['completion_tokens']}"
            )
        out = self.common("single")
        out.update(
            {
                "repeats": a.repeats,
                "max_tokens": a.max_tokens,
                "prompt_tokens": runs[0]["prompt_tokens"],
                "ttft_s_median": med([r["ttft_s"] for r in runs]),
                # run 1 is the first time the server sees this prompt (cold);
                # later repeats may hit a prompt/prefix cache.
                "ttft_s_run1": runs[0]["ttft_s"],
                "ttft_s_median_repeats": med([r["ttft_s"] for r in runs[1:]]),
                "decode_tok_s_median": med([r["decode_tok_s"] for r in runs]),
                "e2e_tok_s_median": med([r["e2e_tok_s"] for r in runs]),
                "completion_tokens": [r["completion_tokens"] for r in runs],
                "hit_max_tokens": all(r["completion_tokens"] >= a.max_tokens for r in runs),
                "finish_reasons": [r["finish_reason"] for r in runs],
                "token_count_source": runs[0]["token_count_source"],
                "sse_chunks": [r["chunks"] for r in runs],
                "ttft_s_all": [r["ttft_s"] for r in runs],
                "decode_tok_s_all": [r["decode_tok_s"] for r in runs],
                "server_cpu_s_per_1k_tok": self.cpu.per_1k(
                    sum(r["completion_tokens"] for r in runs)
                ),
            }
        )
        return out

    async def sc_burst(self) -> dict:
        out = await self.sc_concurrency(levels_n=[self.args.burst_n], tag="burst")
        out["scenario"] = "burst"
        return out

    async def sc_concurrency(self, levels_n=None, tag="request") -> dict:
        a = self.args
        levels_n = levels_n if levels_n is not None else a.concurrency
        levels = []
        for n in levels_n:  # bounded
            prompts = []
            for i in range(n):
                topic = TOPICS[(i + 3 * n) % len(TOPICS)]
                prompts.append(
                    f"[{tag} {n}-{i}] Write a long, detailed essay about {topic}. "
                    "Use many paragraphs and do not stop early."
                )
            self.cpu.begin()
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *[
                    self.stream_chat(
                        [{"role": "user", "content": p}], a.conc_max_tokens, a.conc_extra
                    )
                    for p in prompts
                ]
            )
            wall = time.perf_counter() - t0
            bad = [r for r in results if not r["ok"]]
            results = [r for r in results if r["ok"]]
            if bad:
                log(f"concurrency N={n}: {len(bad)} stream(s) failed: {bad[0].get('error')}")
            if not results:
                levels.append({"n": n, "failed": len(bad), "error": bad[0].get("error")})
                continue
            tot = sum(r["completion_tokens"] for r in results)
            cpu_per_1k = self.cpu.per_1k(tot)
            span = max(r["t_end"] for r in results) - min(r["t_start"] for r in results)
            ttfts = [r["ttft_s"] for r in results]
            # Steady state: window in which every stream has started and none
            # has finished; content chunks received in it per second.
            w0 = max(r["chunk_times"][0] for r in results)
            w1 = min(r["chunk_times"][-1] for r in results)
            steady = None
            if w1 - w0 > 0.5:
                cnt = sum(1 for r in results for t in r["chunk_times"] if w0 <= t <= w1)
                steady = cnt / (w1 - w0)
            lvl = {
                "n": n,
                "failed": len(bad),
                "aggregate_tok_s": tot / span,
                "total_completion_tokens": tot,
                "wall_s": wall,
                "ttft_p50_s": pct(ttfts, 50),
                "ttft_p95_s": pct(ttfts, 95),
                "steady_all_streams_chunks_s": steady,
                "per_stream_decode_tok_s_median": med([r["decode_tok_s"] for r in results]),
                "hit_max_tokens": all(r["completion_tokens"] >= a.conc_max_tokens for r in results),
                "token_count_source": results[0]["token_count_source"],
                "server_cpu_s_per_1k_tok": cpu_per_1k,
            }
            # Where the server sends its timings: each stream's prefill as the engine saw it
            # (from its admission to its first token); a client's TTFT above it is the queue,
            # the HTTP side and the first token's delivery. Equal figures across a burst mean
            # one prefill wave; a spread, waves.
            prompt_ms = [
                r["timings"]["prompt_ms"] for r in results if "prompt_ms" in r.get("timings", {})
            ]
            if prompt_ms:
                lvl["server_prompt_ms_p50"] = pct(prompt_ms, 50)
                lvl["server_prompt_ms_min"] = min(prompt_ms)
                lvl["server_prompt_ms_max"] = max(prompt_ms)
            levels.append(lvl)
            log(
                f"concurrency N={n}: agg={lvl['aggregate_tok_s']:.1f} tok/s "
                f"ttft p50={lvl['ttft_p50_s']:.3f}s p95={lvl['ttft_p95_s']:.3f}s"
                + (
                    f" (server prefill {lvl['server_prompt_ms_min']:.0f}-{lvl['server_prompt_ms_max']:.0f} ms)"
                    if prompt_ms
                    else ""
                )
            )
        out = self.common("concurrency")
        out["max_tokens"] = a.conc_max_tokens
        if a.conc_extra:
            out["extra"] = a.conc_extra
        out["levels"] = levels
        by_n = {lv["n"]: lv["aggregate_tok_s"] for lv in levels if "aggregate_tok_s" in lv}
        if 1 in by_n and by_n and max(by_n) > 1:
            out[f"agg_ratio_N{max(by_n)}_over_N1"] = by_n[max(by_n)] / by_n[1]
        return out

    async def sc_prefix(self) -> dict:
        a = self.args
        base_sys = make_system_prompt(a.system_tokens)
        questions = [
            "Which rule mentions a refund? Answer briefly.",
            "Summarise rule 3 in one sentence.",
            "Is there a rule about shipments? Answer briefly.",
            "List two rules that mention a ticket.",
            "Which rule is the longest? Answer briefly.",
            "What should a worker do with an invoice? Answer briefly.",
            "Give one rule about sessions.",
            "Which rule mentions the warehouse? Answer briefly.",
        ]
        nonce = f"Session {random.randrange(16**8):08x}."
        system = {"role": "system", "content": f"{nonce}\n{base_sys}"}
        history: list[dict] = [system]
        turns = []
        first_msgs = None
        for t in range(a.turns):  # bounded
            history.append({"role": "user", "content": questions[t % len(questions)]})
            msgs = list(history)
            if t == 0:
                first_msgs = list(msgs)
            turns.append(await self.chat_turn("prefix", t + 1, history, a.prefix_max_tokens))
        # Control 1 (opt-in, costs one more cold prefill): last turn's
        # conversation under a fresh nonce -> cold at the same length.
        cold_last = {"ttft_s": None, "prompt_tokens": None, "cached_tokens": None}
        if a.prefix_cold_control:
            last_msgs = [dict(m) for m in history[:-1]]
            last_msgs[0] = {
                "role": "system",
                "content": f"Session {random.randrange(16**8):08x}.\n{base_sys}",
            }
            cold_last = await self.stream_chat(last_msgs, a.prefix_max_tokens)
            if not cold_last["ok"]:
                raise SystemExit(f"prefix cold control failed: {cold_last.get('error')}")
            log(f"prefix cold@last-length ttft={cold_last['ttft_s']:.3f}s")
        # Control 2: exact repeat of turn 1 (fully cached prefix where supported).
        repeat_first = await self.stream_chat(first_msgs, a.prefix_max_tokens)
        if not repeat_first["ok"]:
            raise SystemExit(f"prefix repeat failed: {repeat_first.get('error')}")
        log(f"prefix repeat turn1 ttft={repeat_first['ttft_s']:.3f}s")
        out = self.common("prefix")
        warm = [x["ttft_s"] for x in turns[1:]]
        out.update(
            {
                "system_prompt_tokens_target": a.system_tokens,
                "turns": turns,
                "ttft_cold_turn1_s": turns[0]["ttft_s"],
                "ttft_warm_median_s": med(warm),
                "ttft_warm_last_s": turns[-1]["ttft_s"],
                "ttft_cold_same_length_as_last_s": cold_last["ttft_s"],
                "cold_same_length_prompt_tokens": cold_last["prompt_tokens"],
                "cold_same_length_cached_tokens": cold_last["cached_tokens"],
                "ttft_repeat_turn1_s": repeat_first["ttft_s"],
                "repeat_turn1_cached_tokens": repeat_first["cached_tokens"],
                "warm_last_over_cold_same_length": (
                    turns[-1]["ttft_s"] / cold_last["ttft_s"]
                    if len(turns) > 1 and cold_last["ttft_s"]
                    else None
                ),
                "warm_median_over_cold_turn1": (
                    med(warm) / turns[0]["ttft_s"] if len(turns) > 1 else None
                ),
                "repeat_turn1_over_cold_turn1": repeat_first["ttft_s"] / turns[0]["ttft_s"],
            }
        )
        return out

    async def sc_long_ctx(self) -> dict:
        """An agent session: a long system prompt of rules (--long-system-tokens), then two
        follow-up turns that extend the conversation (~84 and ~22 new tokens). TTFT and
        cached tokens per turn; turn 1 is cold (a fresh nonce opens the prompt)."""
        a = self.args
        nonce = f"Session {random.randrange(16**8):08x}."
        system = f"{nonce}\n{make_system_prompt(a.long_system_tokens)}"
        follow_ups = [
            "Which rule mentions a refund? Answer briefly.",
            "Thanks. Now go through the rules about invoices, shipments and tickets, say which "
            "of them conflict with each other, and propose one short rewording for each "
            "conflicting pair so that an agent following them never has to guess; keep the "
            "answer to a few lines and cite the rule numbers you rely on.",
            "Good. Apply the same check to the rules about refunds only.",
        ]
        history: list[dict] = [{"role": "system", "content": system}]
        turns = []
        for t, question in enumerate(follow_ups):  # bounded: three turns
            history.append({"role": "user", "content": question})
            turn = await self.chat_turn("long_ctx", t + 1, history, a.long_max_tokens, False)
            turns.append(turn)
            if "error" in turn:  # the next turn would extend an answer that never came
                break
        out = self.common("long_ctx")
        out.update(
            {
                "system_prompt_tokens_target": a.long_system_tokens,
                "turns": turns,
                "ttft_s": [x.get("ttft_s") for x in turns],
                "cached_tokens": [x.get("cached_tokens") for x in turns],
            }
        )
        return out

    async def sc_constrained(self) -> dict:
        """``response_format`` json_schema against free decoding, N streams at a time (N in
        --concurrency): aggregate tok/s of each and their ratio. The schema asks for a long
        string, so a constrained answer does not end before max_tokens.

        One json_schema request is sent first, unmeasured: a server may build its grammar
        compiler on the first constrained request. At each N the two modes run in
        --constrained-rounds interleaved rounds (free, json_schema, free, ...): ``ratio`` is
        the median per-round ratio, ``ratio_per_round`` its spread. --constrained-schema:
        ``essay`` (one string of a counted length: llguidance meets a new lexer state every
        token) or ``notes`` (strings of any length, as most schemas have)."""
        a = self.args
        if a.constrained_schema == "notes":  # strings of any length, as many as max_tokens
            notes = {"type": "array", "items": {"type": "string"}, "minItems": a.conc_max_tokens}
            schema = {
                "type": "object",
                "properties": {"notes": notes},
                "required": ["notes"],
                "additionalProperties": False,
            }
        else:  # one string whose length is counted: a new lexer state every token
            schema = {
                "type": "object",
                "properties": {
                    "title": {"type": "string", "maxLength": 40},
                    "essay": {"type": "string", "minLength": 8 * a.conc_max_tokens},
                },
                "required": ["title", "essay"],
                "additionalProperties": False,
            }
        name = a.constrained_schema
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}

        async def run(mode: str, n: int, tag: str, max_tokens: int) -> dict[str, Any]:
            extra = {"response_format": fmt} if mode == "json_schema" else None
            ignore = self.send_ignore_eos
            self.send_ignore_eos = ignore and mode == "free"  # a grammar ends by itself
            prompts = [
                f"[{mode} {tag}{n}-{i}] Reply in JSON: a title and a long essay about "
                f"{TOPICS[(i + 3 * n) % len(TOPICS)]}."
                for i in range(n)
            ]
            try:
                results = await asyncio.gather(
                    *[
                        self.stream_chat([{"role": "user", "content": q}], max_tokens, extra)
                        for q in prompts
                    ]
                )
            finally:
                self.send_ignore_eos = ignore
            ok = [r for r in results if r["ok"]]
            if len(ok) < n:
                bad = next(r for r in results if not r["ok"])
                return {"failed": n - len(ok), "error": bad.get("error")}
            span = max(r["t_end"] for r in ok) - min(r["t_start"] for r in ok)
            return {
                "aggregate_tok_s": sum(r["completion_tokens"] for r in ok) / span,
                "tokens": [r["completion_tokens"] for r in ok],
                "ttft_p50_s": pct([r["ttft_s"] for r in ok], 50),
            }

        warm = await run("json_schema", 1, "warm-up ", min(16, a.conc_max_tokens))
        if "failed" in warm:
            log(f"constrained warm-up failed: {warm['error']}")
        levels = []
        for n in a.concurrency:  # bounded
            row: dict[str, Any] = {"n": n}
            n_rounds = a.constrained_rounds
            per_mode: dict[str, list[dict[str, Any]]] = {"free": [], "json_schema": []}
            ratios: list[float] = []
            for k in range(n_rounds):  # bounded
                tag = f"r{k} " if n_rounds > 1 else ""
                got = {mode: await run(mode, n, tag, a.conc_max_tokens) for mode in per_mode}
                for mode, res in got.items():
                    per_mode[mode].append(res)
                free, cons = got["free"], got["json_schema"]
                if free.get("aggregate_tok_s") and cons.get("aggregate_tok_s"):
                    ratios.append(cons["aggregate_tok_s"] / free["aggregate_tok_s"])
            for mode, runs in per_mode.items():
                good = [r for r in runs if "aggregate_tok_s" in r]
                if not good:
                    row[mode] = runs[0]
                    continue
                row[mode] = {
                    "aggregate_tok_s": med([r["aggregate_tok_s"] for r in good]),
                    "tokens": [t for r in good for t in r["tokens"]],
                    "ttft_p50_s": med([r["ttft_p50_s"] for r in good]),
                }
                if n_rounds > 1:
                    row[mode]["aggregate_tok_s_all"] = [r.get("aggregate_tok_s") for r in runs]
            if ratios:
                row["ratio"] = med(ratios)
                row["rounds"] = n_rounds
                row["ratio_per_round"] = {
                    "median": med(ratios),
                    "min": min(ratios),
                    "max": max(ratios),
                    "all": ratios,
                }
                log(
                    f"constrained N={n}: json_schema / free = {row['ratio']:.2f} "
                    f"({min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} rounds)"
                )
            levels.append(row)
        out = self.common("constrained")
        out.update(
            {"max_tokens": a.conc_max_tokens, "levels": levels, "warm_up": "failed" not in warm}
        )
        return out

    async def sc_nonstream(self) -> dict:
        a = self.args
        runs = []
        for i in range(a.nonstream_repeats):  # bounded
            r = await self.nonstream_chat(
                [{"role": "user", "content": SHORT_PROMPT}], a.nonstream_max_tokens
            )
            if not r["ok"]:
                raise SystemExit(f"nonstream run {i} failed: {r.get('error')}")
            runs.append(r)
        lat = [r["latency_s"] for r in runs]
        out = self.common("nonstream")
        out.update(
            {
                "repeats": a.nonstream_repeats,
                "max_tokens": a.nonstream_max_tokens,
                "latency_s_median": med(lat),
                "latency_s_min": min(lat),
                "latency_s_max": max(lat),
                "completion_tokens": [r["completion_tokens"] for r in runs],
                "prompt_tokens": runs[0]["prompt_tokens"],
                "sample_text": runs[0]["text"],
            }
        )
        log(f"nonstream: median latency {out['latency_s_median']:.3f}s")
        return out


SCENARIOS = ["burst", "single", "concurrency", "prefix", "nonstream", "long_ctx", "constrained"]
DEFAULT_SCENARIOS = ["burst", "single", "concurrency", "prefix", "nonstream"]


async def amain(args: argparse.Namespace) -> int:
    wanted = (
        DEFAULT_SCENARIOS
        if args.scenario == "all"
        else [s.strip() for s in args.scenario.split(",")]
    )
    for s in wanted:
        if s not in SCENARIOS:
            raise SystemExit(f"unknown scenario {s!r}; choose from {SCENARIOS} or 'all'")
    b = Bench(args)
    t_all = time.perf_counter()
    try:
        await b.probe()
        warmed = False
        for s in wanted:
            if s != "burst" and not warmed:
                await b.warmup()
                await b.settle()
                warmed = True
            t0 = time.perf_counter()
            res = await getattr(b, f"sc_{s}")()
            res["scenario_wall_s"] = time.perf_counter() - t0
            if b.notes:
                res["notes"] = b.notes
            line = json.dumps(rnd(res), separators=(",", ":"))
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
    finally:
        await b.close()
    log(f"total wall {time.perf_counter() - t_all:.1f}s")
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 1)[1],
    )
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8090/v1",
        help="OpenAI base URL (…/v1); a bare http://host:port gets /v1 appended",
    )
    p.add_argument("--model", default="default_model")
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="Bearer token (default: $OPENAI_API_KEY, else none)",
    )
    p.add_argument(
        "--scenario", default="all", help=f"comma list from {SCENARIOS} or 'all' (default)"
    )
    p.add_argument("--label", default="", help="free text copied into every result line")
    p.add_argument("--out", default=None, help="append JSON lines to this file too")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--concurrency", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",") if x]
    )
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--burst-n", type=int, default=8, help="streams in the burst scenario")
    p.add_argument(
        "--conc-max-tokens",
        type=int,
        default=32,
        help="max_tokens per stream in the concurrency scenario (default 32)",
    )
    p.add_argument(
        "--conc-extra",
        type=json.loads,
        default=None,
        help='fields added to each concurrency request, e.g. \'{"logprobs": true, "top_logprobs": 5}\'',
    )
    p.add_argument("--turns", type=int, default=4)
    p.add_argument(
        "--prefix-cold-control",
        action="store_true",
        help="also send the last turn under a fresh nonce (cold, same length)",
    )
    p.add_argument("--prefix-max-tokens", type=int, default=32)
    p.add_argument(
        "--long-system-tokens",
        type=int,
        default=27670,
        help="long_ctx: system prompt length to aim for (an agent's prompt)",
    )
    p.add_argument("--long-max-tokens", type=int, default=16, help="long_ctx: tokens per turn")
    p.add_argument("--nonstream-repeats", type=int, default=5)
    p.add_argument("--nonstream-max-tokens", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--settle-s",
        type=float,
        default=150.0,
        help="after the warm-up requests, wait this long at most for the server's idle-time "
        "warm-up to end (/health's warming_up; an 8B's took 105 s on an empty CUDA kernel "
        "cache)",
    )
    p.add_argument(
        "--constrained-rounds",
        type=int,
        default=5,
        help="constrained: interleaved rounds (free, json_schema) at each N",
    )
    p.add_argument(
        "--constrained-schema",
        default="essay",
        choices=["essay", "notes"],
        help="constrained: the schema (essay: one string of a counted length; notes: strings)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="per-request read timeout, s")
    p.add_argument("--no-ignore-eos", action="store_true")
    p.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="the server's process: report its CPU seconds per 1,000 generated tokens "
        "(server_cpu_s_per_1k_tok) for the single and concurrency scenarios",
    )
    p.add_argument(
        "--client",
        choices=["raw", "httpx"],
        default="raw",
        help="streamed requests over bare sockets (default: cheap enough per chunk for tens "
        "of streams of a fast server) or httpx (the kit's reader before 2026-12-02)",
    )
    a = p.parse_args(argv)
    bounds = [
        ("repeats", 1, 20),
        ("turns", 1, 16),
        ("nonstream_repeats", 1, 50),
        ("warmup", 0, 10),
        ("constrained_rounds", 1, 20),
        ("max_tokens", 1, 4096),
        ("conc_max_tokens", 1, 4096),
        ("prefix_max_tokens", 1, 4096),
        ("system_tokens", 50, 16000),
    ]
    for name, lo, hi in bounds:
        v = getattr(a, name)
        if not lo <= v <= hi:
            p.error(f"--{name.replace('_', '-')} must be in [{lo}, {hi}]")
    if not a.concurrency or max(a.concurrency) > 64 or min(a.concurrency) < 1:
        p.error("--concurrency values must be in [1, 64]")
    return a


def main() -> int:
    return asyncio.run(amain(parse_args()))


if __name__ == "__main__":
    sys.exit(main())
