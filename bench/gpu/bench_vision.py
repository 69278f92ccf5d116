#!/usr/bin/env python3
"""Vision-language serving over the OpenAI API: the same scenarios against any server (this one,
mlx_vlm.server), one JSON line per scenario.

Scenarios (--scenario, comma list):
  single      one stream at a time with a fresh image each (--repeats): TTFT, decode tok/s
  concurrent  --concurrency streams at once, each with its own image: aggregate tok/s
  session     three turns on one image sent in turn 1 (each turn resends the conversation, as chat
              clients do): TTFT, prompt and cached tokens per turn
  text        a text-only request, one stream (--repeats): TTFT, decode tok/s (served by a VLM, or
              by its text twin: vision.sh prints the ratio)
--summary FILE prints the ratios of the lines in FILE (by --server and --kind) and appends them.
Images are PNGs made here (no Pillow needed): --size pixels square, a gradient seeded per image.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import struct
import sys
import time
import zlib
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_openai import Bench, rnd  # noqa: E402

QUESTION = "Describe this picture in detail: colours, shapes, and what it might show."
FOLLOW_UPS = ["Which colour covers most of it?", "Write a short poem about it."]
TEXT_PROMPT = "Write a long essay about the history of lighthouses. Do not stop early."


def png(size: int, seed: int) -> bytes:
    """A ``size`` x ``size`` RGB gradient, different for each seed."""
    r0, g0, b0 = (seed * 67) % 256, (seed * 131 + 40) % 256, (seed * 29 + 90) % 256
    rows = []
    for y in range(size):
        row = bytearray([0])  # filter: none
        for x in range(size):
            row += bytes(((r0 + x) % 256, (g0 + y) % 256, (b0 + x + y) % 256))
        rows.append(bytes(row))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    raw = zlib.compress(b"".join(rows), 6)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", raw) + chunk(b"IEND", b"")


def image_message(text: str, size: int, seed: int) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png(size, seed)).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return {"role": "user", "content": parts}


def _fields(r: dict) -> dict:
    keep = ["ttft_s", "decode_tok_s", "completion_tokens", "prompt_tokens", "cached_tokens"]
    return {k: rnd(r.get(k)) for k in keep}


def _med(rs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rs if r.get(key) is not None]
    return rnd(median(vals)) if vals else None


class VisionBench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.http = Bench(args)
        self.seed = 1000  # fresh images for each request (the cache must not serve them)

    def _next_image(self, text: str, size: int | None = None) -> dict:
        self.seed += 1
        return image_message(text, size or self.args.size, self.seed)

    async def stream(self, messages: list[dict], max_tokens: int | None = None) -> dict:
        return await self.http.stream_chat(messages, max_tokens or self.args.max_tokens)

    def emit(self, scenario: str, row: dict) -> dict:
        line = {
            "bench": "vision",
            "scenario": scenario,
            "server": self.args.server,
            "kind": self.args.kind,
            "label": self.args.label,
            **row,
        }
        print(json.dumps(line), flush=True)
        if self.args.out:
            with open(self.args.out, "a") as f:
                f.write(json.dumps(line) + "\n")
        return line

    @staticmethod
    def _errors(rs: list[dict]) -> dict:
        bad = [r for r in rs if not r.get("ok")]
        return {"errors": len(bad), "error": bad[0].get("error") if bad else None}

    async def single(self) -> None:
        rs = []
        for _ in range(self.args.repeats):
            rs.append(await self.stream([self._next_image(QUESTION)]))
        row = {"ttft_s": _med(rs, "ttft_s"), "decode_tok_s": _med(rs, "decode_tok_s")}
        row.update(prompt_tokens=_med(rs, "prompt_tokens"), runs=[_fields(r) for r in rs])
        self.emit("single", {**row, **self._errors(rs)})

    async def concurrent(self) -> None:
        n = self.args.concurrency
        messages = [[self._next_image(QUESTION)] for _ in range(n)]
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(self.stream(m) for m in messages))
        wall = time.perf_counter() - t0
        tokens = sum(r.get("completion_tokens") or 0 for r in rs if r.get("ok"))
        row = {"streams": n, "wall_s": rnd(wall), "completion_tokens": tokens}
        row.update(agg_tok_s=rnd(tokens / wall), ttft_s=_med(rs, "ttft_s"))
        row["decode_tok_s"] = _med(rs, "decode_tok_s")
        self.emit("concurrent", {**row, **self._errors(rs)})

    async def session(self) -> None:
        # A photo as people send one (--session-size): turn 1's image is most of the prompt.
        messages = [self._next_image(QUESTION, self.args.session_size)]
        turns = []
        for follow_up in [None, *FOLLOW_UPS]:
            if follow_up is not None:
                messages += [{"role": "user", "content": follow_up}]
            r = await self.stream(messages, self.args.session_max_tokens)
            turns.append(r)
            messages += [{"role": "assistant", "content": r.get("text") or "..."}]
        row: dict[str, Any] = {"turns": [_fields(r) for r in turns]}
        t1 = turns[0].get("ttft_s")
        for i, r in enumerate(turns[1:], start=2):
            prompt, cached = r.get("prompt_tokens"), r.get("cached_tokens")
            row[f"turn{i}_cached_frac"] = rnd(cached / prompt) if prompt and cached else 0.0
            ttft = r.get("ttft_s")
            row[f"turn{i}_ttft_ratio"] = rnd(ttft / t1) if ttft and t1 else None
        self.emit("session", {**row, **self._errors(turns)})

    async def text(self) -> None:
        rs = []
        for _ in range(self.args.repeats):
            rs.append(await self.stream([{"role": "user", "content": TEXT_PROMPT}]))
        row = {"ttft_s": _med(rs, "ttft_s"), "decode_tok_s": _med(rs, "decode_tok_s")}
        self.emit("text", {**row, "runs": [_fields(r) for r in rs], **self._errors(rs)})

    async def first_use(self) -> None:
        """The warm-up, timed: on CUDA each shape a server meets first builds kernels
        (seconds; each server gets a fresh kernel cache from vision.sh), so the first text
        request, the first image and the first batch of N images are a line of their own,
        and the scenarios after them measure warm shapes."""
        t0 = time.perf_counter()
        await self.http.probe()
        row: dict[str, Any] = {"probe_s": rnd(time.perf_counter() - t0)}
        text = await self.stream([{"role": "user", "content": TEXT_PROMPT}], 8)
        row["text_ttft_s"] = rnd(text.get("ttft_s"))
        # A second text of another length: is the first text's cost once, or per length?
        other = await self.stream([{"role": "user", "content": TEXT_PROMPT + " Begin."}], 8)
        row["text2_ttft_s"] = rnd(other.get("ttft_s"))
        if self.args.kind == "twin":  # a text model: no images
            self.emit("first_use", {**row, **self._errors([text, other])})
            return
        one = await self.stream([self._next_image(QUESTION)], 8)
        n = self.args.concurrency
        many = await asyncio.gather(
            *(self.stream([self._next_image(QUESTION)], 8) for _ in range(n))
        )
        row.update(image_ttft_s=rnd(one.get("ttft_s")), streams=n)
        row["batch_ttft_s"] = _med(list(many), "ttft_s")
        self.emit("first_use", {**row, **self._errors([text, other, one, *many])})

    async def run(self) -> int:
        try:
            if self.args.warmup:
                await self.first_use()
            else:
                await self.http.probe()
            for name in self.args.scenario.split(","):
                await getattr(self, name)()
        finally:
            await self.http.close()
        return 0


def summary(path: Path, out: Path | None = None) -> dict:
    """The ratios the issue's targets name, from the lines of one run."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    runs = [x for x in lines if x.get("bench") == "vision" and "server" in x]  # not summaries
    got = {(x["server"], x["kind"], x["scenario"]): x for x in runs}

    def val(server: str, kind: str, scenario: str, key: str) -> Any:
        return (got.get((server, kind, scenario)) or {}).get(key)

    def ratio(a: Any, b: Any) -> float | None:
        return (
            rnd(a / b, 3)
            if isinstance(a, int | float) and isinstance(b, int | float) and b
            else None
        )

    rows: dict[str, Any] = {}
    for server in sorted({s for s, _, _ in got}):
        one = val(server, "vlm", "single", "decode_tok_s")
        rows[f"{server}: N streams / one stream (agg tok/s)"] = ratio(
            val(server, "vlm", "concurrent", "agg_tok_s"), one
        )
        for turn in (2, 3):
            rows[f"{server}: turn {turn} cached fraction"] = val(
                server, "vlm", "session", f"turn{turn}_cached_frac"
            )
            rows[f"{server}: turn {turn} TTFT / turn 1"] = val(
                server, "vlm", "session", f"turn{turn}_ttft_ratio"
            )
    rows["ours: text to the VLM / text twin (decode tok/s)"] = ratio(
        val("ours", "vlm", "text", "decode_tok_s"), val("ours", "twin", "text", "decode_tok_s")
    )
    for scenario, key in [("single", "decode_tok_s"), ("concurrent", "agg_tok_s")]:
        rows[f"ours / mlxvlm: {scenario} {key}"] = ratio(
            val("ours", "vlm", scenario, key), val("mlxvlm", "vlm", scenario, key)
        )
    rows["ours / mlxvlm: single ttft_s"] = ratio(
        val("ours", "vlm", "single", "ttft_s"), val("mlxvlm", "vlm", "single", "ttft_s")
    )
    for key in (
        "probe_s",
        "text_ttft_s",
        "text2_ttft_s",
        "image_ttft_s",
        "batch_ttft_s",
    ):  # lower is better
        rows[f"ours / mlxvlm: first use {key}"] = ratio(
            val("ours", "vlm", "first_use", key), val("mlxvlm", "vlm", "first_use", key)
        )
    width = max(len(k) for k in rows)
    for k, v in rows.items():
        print(f"{k:<{width}}  {v if v is not None else '-'}")
    line = {"bench": "vision", "scenario": "summary", "ratios": rows}
    if out is not None:
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")
    return line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8090/v1")
    p.add_argument("--model", default="m", help="the model name the server answers to")
    p.add_argument("--server", default="ours", help="who serves (ours, mlxvlm): for the ratios")
    p.add_argument(
        "--kind", default="vlm", choices=["vlm", "twin"], help="the VLM or its text twin"
    )
    p.add_argument("--label", default="")
    p.add_argument("--scenario", default="single,concurrent,session,text")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--session-max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="1: time the first uses first (first_use)")
    p.add_argument("--size", type=int, default=448, help="image side in pixels")
    p.add_argument(
        "--session-size", type=int, default=None, help="the session's image side (--size)"
    )
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--server-pid", type=int, default=None, help="the server's PID (its CPU)")
    p.add_argument("--summary", default=None, help="print the ratios of this results file")
    a = p.parse_args(argv)
    # What bench_openai's client reads.
    a.api_key, a.no_ignore_eos, a.client = None, False, "raw"
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summary:
        summary(Path(args.summary), Path(args.out) if args.out else None)
        return 0
    return asyncio.run(VisionBench(args).run())


if __name__ == "__main__":
    sys.exit(main())
