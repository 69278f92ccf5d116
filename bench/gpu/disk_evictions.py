"""What handing evicted prefix-cache entries to the disk tier costs the engine's step loop.

A full RAM tier evicts an entry for every new one stored, and an evicted entry of at least
``--min-tokens`` tokens goes to the disk tier (``DiskPromptCache.save``, on the engine's thread:
it cuts the arrays and launches their evaluation; ``settle`` hands them to the writer steps
later, where evaluating them once waited for the step in flight).
Two engines on one model, each with a RAM tier of ``--entries`` entries, one with a disk tier
(in a temporary folder) and one without, take bursts of the same shape in interleaved rounds
(the order alternating): ``N`` streams of distinct prompts (a system prompt of
``--prompt-tokens`` as ``make_system_prompt`` counts them, led by a fresh tag; the row gives
the real length), so every finishing stream evicts one; each answer runs to ``--max-tokens``
(``ignore_eos``). Printed per level: each engine's aggregate and decode tok/s and evictions
(the disk one's entries on disk and saves dropped with the writer's queue full), then the
per-round ratios with / without the disk tier (median and spread) and the ``disk.save`` calls
with their time on the engine's thread (``phases``).

    python3 disk_evictions.py --model DIR --label "disk 1b-0" --levels 8,32 --out results.jsonl
        [--rounds 5] [--prompt-tokens 400] [--max-tokens 64] [--entries 2] [--min-tokens 256]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import layers  # noqa: E402
import mlx.core as mx  # noqa: E402
import phases  # noqa: E402
from bench_openai import make_system_prompt  # noqa: E402
from mlx_lm import load  # noqa: E402


def prompts(tok: Any, n: int, prompt_tokens: int) -> list[list[int]]:
    """``n`` prompts sharing no prefix (a fresh session tag leads each)."""
    system = make_system_prompt(prompt_tokens)
    return [
        layers.chat_ids(tok, "Summarise the rules in one line.", f"{uuid.uuid4().hex}\n{system}")
        for _ in range(n)
    ]


def cache_stats(engine: Any) -> dict[str, int]:
    cache = engine.prefix_cache
    stats = cache.stats() if cache is not None else {}
    keep = ("prompt_cache_evictions", "prompt_cache_disk_entries")
    out = {k: int(v) for k, v in stats.items() if k in keep}
    disk = getattr(cache, "disk", None)
    if disk is not None:
        out["disk_dropped"] = int(getattr(disk, "dropped", 0))
    return out


async def level(engines: dict[str, Any], tok: Any, a: argparse.Namespace, n: int) -> None:
    for engine in engines.values():  # the level's shapes built before anything is timed
        await layers.engine_once(engine, prompts(tok, n, a.prompt_tokens), 8, True)
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in engines}
    saves = {"n": 0, "s": 0.0}
    before = {k: cache_stats(e) for k, e in engines.items()}
    for r in range(a.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            batch = prompts(tok, n, a.prompt_tokens)
            phases.reset()
            rows[name].append(await layers.engine_once(engines[name], batch, a.max_tokens, True))
            snap = phases.snapshot().get("disk.save", {"n": 0, "s": 0.0})
            saves["n"] += snap["n"]
            saves["s"] += snap["s"]
    after = {k: cache_stats(e) for k, e in engines.items()}
    for name, xs in rows.items():
        counts = {k: after[name][k] - before[name].get(k, 0) for k in after[name]}
        layers.emit(
            layer="disk_evictions",
            engine=name,
            n=n,
            rounds=a.rounds,
            aggregate_tok_s=layers.spread([x["aggregate_tok_s"] for x in xs]),
            decode_tok_s=layers.spread([x["decode_tok_s"] for x in xs]),
            **counts,
        )
    pairs = list(zip(rows["disk"], rows["ram"], strict=True))
    ratio = [
        d["decode_tok_s"] / m["decode_tok_s"]
        for d, m in pairs
        if m["decode_tok_s"] > 0 and d["decode_tok_s"] > 0
    ]
    whole = [d["aggregate_tok_s"] / m["aggregate_tok_s"] for d, m in pairs]
    layers.emit(
        layer="disk_evictions",
        what="ratio",
        n=n,
        prompt_tokens=len(prompts(tok, 1, a.prompt_tokens)[0]),
        decode_disk_over_ram_per_round=layers.spread(ratio) if ratio else None,
        aggregate_disk_over_ram_per_round=layers.spread(whole),
        disk_saves=saves["n"],
        disk_save_ms_each=saves["s"] * 1000 / saves["n"] if saves["n"] else None,
    )


async def run(model: Any, tok: Any, a: argparse.Namespace, folder: Path) -> None:
    from mlx_server.engine.cache.disk import DiskPromptCache

    disk = DiskPromptCache(folder, 64 << 30, min_tokens=a.min_tokens)
    common = {"prompt_cache_size": a.entries}
    engines = {
        "disk": layers.make_engine(model, tok, max(a.levels), prompt_cache_disk=disk, **common),
        "ram": layers.make_engine(model, tok, max(a.levels), **common),
    }
    for engine in engines.values():
        engine.start()
        if hasattr(engine, "wait_ready"):
            await asyncio.to_thread(engine.wait_ready)
        deadline = time.perf_counter() + 150
        while getattr(engine, "warming_up", False) and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)  # the idle-time warm-up, before anything is timed
    try:
        for n in a.levels:
            await level(engines, tok, a, n)
    finally:
        for engine in engines.values():
            engine.shutdown()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--label", default="")
    p.add_argument("--levels", default="8,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--entries", type=int, default=2, help="the RAM tier's entries")
    p.add_argument("--min-tokens", type=int, default=256, help="the disk tier's shortest entry")
    p.add_argument("--dtype", default="", help="cast the weights (e.g. float32 on a CPU)")
    p.add_argument("--out")
    a = p.parse_args()
    layers.OUT, layers.LABEL = a.out, a.label
    phases.install()
    model, tok = load(a.model)
    if a.dtype:
        model.set_dtype(getattr(mx, a.dtype))
    with tempfile.TemporaryDirectory(prefix="disk-evictions-") as folder:
        asyncio.run(run(model, tok, a, Path(folder)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
