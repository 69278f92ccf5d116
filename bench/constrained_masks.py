"""The CPU cost of grammar masks per decode step, for a batch of 1, 8 and 32 sequences:
the per-row processor path (before) against one batched call (after), side by side.

Each sequence has its own llguidance matcher for the JSON schema of ``bench/constrained.py``
(on the demo model's 49,152-token vocabulary) and walks a path of its own (a random allowed
token each step, seeded). Per step, on twin states of the same walk:

- ``before``: what mlx-lm's per-row processor calls do (``BatchRunner(batch_grammars=False)``):
  ``GrammarLogitsProcessor(context, logits[i:i+1])`` for each row (read the row's last token,
  consume it, fill its mask, unpack it, one ``where``), then a concatenation;
- ``after``: ``GrammarMasks.apply`` (what ``BatchRunner`` does now): every row consumes and
  fills in one call each (llguidance's thread pool with ``--threads`` > 1, else inline), the
  masks applied with one ``where``; with the pool's default size and with 1 thread.

Each is split into ``fill`` (the Python call: consuming, filling, building the MLX graph)
and ``apply`` (evaluating the masked logits), and the two paths' outputs are checked equal.
Prints one JSON line per batch size: median milliseconds per step (and 90th percentiles)
and the ratio before / after. The host is shared: compare within a line.

    PYTHONPATH=src:bench .venv/bin/python bench/constrained_masks.py [--model DIR] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from constrained import SCHEMA
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlx_server.engine.grammar.constraints import ConstraintCompiler, ConstraintSpec
from mlx_server.engine.grammar.masks import BatchGrammar, GrammarMasks, default_threads
from mlx_server.engine.grammar.processor import GrammarLogitsProcessor


def ms(xs: list[float]) -> float | None:
    return round(statistics.median(xs) * 1000, 3) if xs else None


def p90(xs: list[float]) -> float | None:
    return round(sorted(xs)[int(0.9 * (len(xs) - 1))] * 1000, 3) if xs else None


def per_row(procs: list[GrammarLogitsProcessor], contexts: list[list[int]], logits: mx.array):
    """The per-row path; (fill seconds, apply seconds, masked logits)."""
    t0 = time.perf_counter()
    rows = [
        p(mx.array(c), logits[i : i + 1])
        for i, (p, c) in enumerate(zip(procs, contexts, strict=True))
    ]
    out = mx.concatenate(rows, axis=0)
    t1 = time.perf_counter()
    mx.eval(out)
    return t1 - t0, time.perf_counter() - t1, out


def batched(masks: GrammarMasks, procs: list[GrammarLogitsProcessor], tokens: list[int], logits):
    """The batch path; (fill seconds, apply seconds, masked logits)."""
    t0 = time.perf_counter()
    out = masks.apply([BatchGrammar(p) for p in procs], tokens, logits)
    t1 = time.perf_counter()
    mx.eval(out)
    return t1 - t0, time.perf_counter() - t1, out


def run(compiler: Any, n: int, steps: int, vocab: int, threads: list[int]) -> dict[str, Any]:
    spec = ConstraintSpec.json_schema(SCHEMA)
    ways = ["before"] + [f"after_t{t}" for t in threads]
    procs = {w: [compiler.processor(spec) for _ in range(n)] for w in ways}
    masks = {f"after_t{t}": GrammarMasks(threads=t) for t in threads}
    rng = random.Random(n)
    contexts = [[1] for _ in range(n)]  # one "prompt" token: the first call skips it
    times: dict[str, dict[str, list[float]]] = {w: {"fill": [], "apply": []} for w in ways}
    done = 0
    for step in range(steps):
        logits = mx.array(np.random.default_rng(step).normal(size=(n, vocab)), dtype=mx.float32)
        mx.eval(logits)
        outs = {}
        order = ways if step % 2 else ways[::-1]  # warm caches favour no one way
        for w in order:
            if w == "before":
                fill, apply, out = per_row(procs[w], contexts, logits)
            else:
                fill, apply, out = batched(masks[w], procs[w], [c[-1] for c in contexts], logits)
            times[w]["fill"].append(fill)
            times[w]["apply"].append(apply)
            outs[w] = np.array(out)
        for w in ways[1:]:
            assert np.array_equal(outs[w], outs["before"]), f"{w} differs at step {step}"
        allowed = [np.flatnonzero(row > -np.inf) for row in outs["before"]]
        if all(p.matcher.is_stopped() for p in procs["before"]):
            break
        for c, ids in zip(contexts, allowed, strict=True):
            c.append(int(ids[rng.randrange(len(ids))]))
        done += 1
    row: dict[str, Any] = {"bench": "constrained_masks", "sequences": n, "steps": done}
    for w in ways:
        fill, apply = times[w]["fill"], times[w]["apply"]
        total = [a + b for a, b in zip(fill, apply, strict=True)]
        row[w] = {
            "fill_ms": ms(fill),
            "apply_ms": ms(apply),
            "total_ms": ms(total),
            "total_p90_ms": p90(total),
        }
    for w in ways[1:]:
        row[f"ratio_before_over_{w}"] = round(row["before"]["total_ms"] / row[w]["total_ms"], 2)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--sizes", default="1,8,32")
    p.add_argument(
        "--threads",
        default=None,
        help="comma-separated thread-pool sizes to time (default: 1 and llguidance's default)",
    )
    a = p.parse_args()
    tok = load_tokenizer(Path(a.model))
    compiler = ConstraintCompiler(tok)
    vocab = len(tok.vocab)
    threads = sorted(
        {1, default_threads()} if a.threads is None else {int(t) for t in a.threads.split(",")}
    )
    for n in [int(x) for x in a.sizes.split(",")]:
        row = run(compiler, n, a.steps, vocab, threads)
        row.update(cpus=os.cpu_count(), vocab=vocab, load=round(os.getloadavg()[0], 1))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
