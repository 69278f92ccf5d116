"""TTFT of a long prompt after a server restart: cold (empty cache directory) against the
prefix cache's disk tier, on the demo model, side by side in one run.

Each repetition: start the server on a fresh directory, send the ~4,000-token prompt (cold),
send it again (RAM hit), stop the server (SIGTERM: it writes what RAM holds), start it again
on the same directory and send the prompt once more (disk hit); restart once more and ask a
new question after the same system prompt (the shared prefix from disk).

    .venv/bin/python bench/prompt_cache_disk.py              # f32 + OpenBLAS, 2 repetitions
    .venv/bin/python bench/prompt_cache_disk.py --config q4 --reps 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from bench_procs import ROOT, Server, stream_chat

CONFIGS = {
    "f32+openblas": ("smollm2-135m-instruct-f32", True),
    "f32": ("smollm2-135m-instruct-f32", False),
    "q4": ("smollm2-135m-instruct", False),
    "q4+openblas": ("smollm2-135m-instruct", True),
}


def system_prompt(n_rules: int) -> str:
    """A long, fixed system prompt (an agent's instructions and tool descriptions)."""
    lines = ["You are a coding agent working in a large repository. Follow these rules."]
    for i in range(n_rules):
        lines.append(
            f"Rule {i}: when a task touches module number {i * 7 % 97}, read its tests first, "
            f"keep functions under {20 + i % 30} lines and explain changes in one sentence."
        )
    return "\n".join(lines)


def messages(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="f32+openblas", choices=sorted(CONFIGS))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rules", type=int, default=95, help="system-prompt length (~41 tokens each)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--extra", default="", help="more server flags, e.g. '--kv-bits 8'")
    args = ap.parse_args()
    name, openblas = CONFIGS[args.config]
    model = str(ROOT / "models" / name)
    system = system_prompt(args.rules)
    rows = []
    for rep in range(args.reps):
        cache_dir = Path(tempfile.mkdtemp(prefix="bench-prompt-cache-"))
        extra = ["--ctx-size", "8192", "--prompt-cache-dir", str(cache_dir), *args.extra.split()]
        q1, q2 = (
            f"Question {rep}: which rule covers module 5?",
            f"Question {rep}: summarise rule 3.",
        )
        srv = Server("ours", model, openblas, extra).start()
        cold = stream_chat(srv.base, messages(system, q1), args.max_tokens)
        ram = stream_chat(srv.base, messages(system, q1), args.max_tokens)
        t0 = time.perf_counter()
        srv.stop()
        stop_s = time.perf_counter() - t0
        srv = Server("ours", model, openblas, extra).start()
        disk = stream_chat(srv.base, messages(system, q1), args.max_tokens)
        health = httpx.get(srv.base + "/health").json()
        srv.stop()
        srv = Server("ours", model, openblas, extra).start()
        other = stream_chat(srv.base, messages(system, q2), args.max_tokens)
        srv.stop()
        size = sum(f.stat().st_size for f in cache_dir.rglob("*") if f.is_file())
        shutil.rmtree(cache_dir, ignore_errors=True)
        row = {
            "rep": rep,
            "prompt_tokens": cold["prompt_tokens"],
            "cold_ttft": cold["ttft"],
            "ram_ttft": ram["ttft"],
            "disk_ttft": disk["ttft"],
            "disk_cached": disk["cached_tokens"],
            "system_from_disk_ttft": other["ttft"],
            "system_cached": other["cached_tokens"],
            "same_text": disk["text"] == cold["text"],
            "stop_s": stop_s,
            "dir_mb": size / 2**20,
            "disk_hits": health.get("prompt_cache_disk_hits"),
            "disk_read_mb": health.get("prompt_cache_disk_read_bytes", 0) / 2**20,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(
        f"\nconfig {args.config} {args.extra}, {rows[0]['prompt_tokens']} prompt tokens, medians of {len(rows)}"
    )
    print("| case | TTFT (s) | vs cold |")
    print("|---|---|---|")
    for label, key in (
        ("cold (empty directory)", "cold_ttft"),
        ("same prompt, RAM hit", "ram_ttft"),
        ("after restart, disk hit", "disk_ttft"),
        ("after restart, new question, system prompt from disk", "system_from_disk_ttft"),
    ):
        print(f"| {label} | {med(key):.3f} | {med(key) / med('cold_ttft'):.3f} |")


if __name__ == "__main__":
    main()
