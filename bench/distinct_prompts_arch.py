"""Many distinct long prompts on every architecture family's tiny model (tests/helpers/arch_models.py),
through the real server: a RAM tier of a few entries, so states are evicted to the disk tier
from the fifth prompt on. Each family's server gets ``N`` chat requests, each with its own
system prompt of about 1,000 tokens (a few at a time), then a repeat of the first one.

Checks, per family: every response is a 200, ``/health`` still says ok afterwards, the disk
tier holds entries, and the repeat is served from the cache (cached tokens > 0). Prints one
row per family; exits 1 if any row fails a check.

    PYTHONPATH=src python bench/distinct_prompts_arch.py [-n 100] [--concurrency 4] [--stream] [family ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "helpers"))

from arch_models import FAMILIES, build  # noqa: E402
from support import free_port, launch  # noqa: E402

# About 1,100 tokens with the tiny models' tokenizer; the prompt number leads, so no two
# prompts share more than the template's first tokens.
SYSTEM = "You are agent {n}. Read the files, run the tests, report tersely on each. " * 20
RAM_ENTRIES = 4
TIMEOUT_S = 120.0


def body(n: int) -> dict:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": SYSTEM.format(n=n)},
            {"role": "user", "content": f"Task {n}: go."},
        ],
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
    }


def ask(client: httpx.Client, n: int, stream: bool = False) -> tuple[int, dict]:
    """The status (0: no answer within the timeout) and the body of prompt ``n`` (streamed:
    its last chunk, which carries the usage; 0 unless the stream ends with ``[DONE]``)."""
    try:
        if stream:
            return ask_streamed(client, n)
        r = client.post("/v1/chat/completions", json=body(n))
    except httpx.TimeoutException:
        return 0, {}
    return r.status_code, (r.json() if r.status_code == 200 else {})


def ask_streamed(client: httpx.Client, n: int) -> tuple[int, dict]:
    # Keep-alive frames would keep a read timeout from ever firing: a deadline of its own.
    deadline = time.monotonic() + TIMEOUT_S
    req = {**body(n), "stream": True, "stream_options": {"include_usage": True}}
    last: dict = {}
    with client.stream("POST", "/v1/chat/completions", json=req) as r:
        if r.status_code != 200:
            return r.status_code, {}
        for line in r.iter_lines():
            if line == "data: [DONE]":
                return 200, last
            if line.startswith("data: "):
                last = json.loads(line[len("data: ") :])
            if time.monotonic() > deadline:
                break
    return 0, {}


def family_row(name: str, root: Path, opts: argparse.Namespace) -> tuple[str, bool]:
    model = build(name, root / name)
    args = ["-m", str(model), "--port", str(free_port()), "--ctx-size", "4096"]
    args += ["--prompt-cache-dir", str(root / f"{name}-cache")]
    args += ["--prompt-cache-size", str(RAM_ENTRIES)]
    srv = launch(args)
    start = time.monotonic()
    try:
        assert srv.wait_ready(300), "\n".join(srv.lines[-20:])
        with httpx.Client(base_url=srv.base_url, timeout=TIMEOUT_S) as client:
            with ThreadPoolExecutor(opts.concurrency) as pool:
                asked = pool.map(lambda n: ask(client, n, opts.stream), range(opts.n))
                statuses = [s for s, _ in asked]
            health = client.get("/health").json()
            status, again = ask(client, 0, opts.stream)
        statuses.append(status)
    finally:
        srv.stop()
    seconds = time.monotonic() - start
    answered = sum(s == 200 for s in statuses)
    errors = sum(s >= 500 for s in statuses)
    silent = sum(s == 0 for s in statuses)
    disk = health.get("prompt_cache_disk_entries", 0)
    cached = again.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)
    prompt = again.get("usage", {}).get("prompt_tokens", 0)
    ok = (
        answered == len(statuses)
        and health.get("status") == "ok"
        and disk > 0
        and cached > 0
        and health.get("prompt_cache_failures", 0) == 0
    )
    row = (
        f"| {name} | {answered} / {len(statuses)} | {errors} | {silent} "
        f"| {health.get('prompt_cache_evictions', 0)} | {disk} | {cached} / {prompt} "
        f"| {health.get('prompt_cache_failures', 0)} | {seconds:.0f} | {'ok' if ok else 'FAIL'} |"
    )
    return row, ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=100, help="distinct prompts per family")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--stream", action="store_true", help="streamed requests")
    parser.add_argument("families", nargs="*", default=list(FAMILIES))
    opts = parser.parse_args()
    print(
        f"{opts.n} distinct ~1,100-token prompts per family, {opts.concurrency} at a time, "
        f"{'streamed, ' if opts.stream else ''}RAM tier {RAM_ENTRIES} entries, "
        "then the first prompt again"
    )
    print(
        "| family | answered (200) | 5xx | no answer | RAM evictions | disk entries "
        "| repeat: cached / prompt | cache failures | seconds | |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    all_ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name in opts.families:
            try:
                row, ok = family_row(name, Path(tmp), opts)
            except Exception as e:  # one family's failure is a row, not the end of the table
                row, ok = (
                    f"| {name} | failed: {type(e).__name__}: {e} | | | | | | | | FAIL |",
                    False,
                )
            print(row, flush=True)
            all_ok &= ok
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
