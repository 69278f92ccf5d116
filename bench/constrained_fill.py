"""The host's cost of a batch's grammar masks, no model: ms per step for N rows.

Each of N rows has a matcher of ``constrained_engine.essay_schema`` (a JSON object whose
string runs to the step limit, its length counted: ``--schema essay``) or of ``notes_schema``
(strings of any length: ``--schema notes``) and walks a path of its own (a seeded random allowed token
each step, one without a quote while one exists, so that the string goes on). Per step
``GrammarMasks.compute`` consumes the rows' tokens and fills their masks: inline (one row
after another, each fill outside the interpreter lock) and on llguidance's pool of T
threads (``--threads``), on twin walks. With ``--busy K``, K other threads run Python
meanwhile (what a server's event loop does while the engine steps): how much the lock taken
again between rows costs. Prints one JSON line per (N, way): median and 90th percentile.

    PYTHONPATH=src:bench .venv/bin/python bench/constrained_fill.py [--model DIR]
        [--sizes 1,32] [--threads 2,4,8] [--steps 100] [--busy 0,1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from constrained_engine import SCHEMAS
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlx_server.engine.grammar.constraints import ConstraintCompiler, ConstraintSpec
from mlx_server.engine.grammar.masks import BatchGrammar, GrammarMasks


def _busy(stop: threading.Event) -> None:
    """Pure Python until told to stop: holds the interpreter lock as a busy loop would."""
    x = 0
    while not stop.is_set():
        for i in range(200):
            x += i


def walk(
    compiler: ConstraintCompiler,
    masks: GrammarMasks,
    n: int,
    steps: int,
    vocab: int,
    quotes: Any,
    schema: str = "essay",
) -> list[float]:
    rng = np.random.default_rng(n)
    spec = ConstraintSpec.json_schema(SCHEMAS[schema](steps))
    rows = [BatchGrammar(compiler.processor(spec)) for _ in range(n)]
    tokens = [0] * n
    took = []
    for _ in range(steps):
        t = time.perf_counter()
        plan = masks.plan(rows, tokens)
        if plan is None:
            break
        plan = masks.compute(plan, vocab)
        took.append(time.perf_counter() - t)
        assert plan.words is not None
        bits = np.unpackbits(plan.words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for j, (i, _) in enumerate(plan.live):
            allowed = np.flatnonzero(bits[j])
            inside = allowed[~quotes[allowed]]
            pool = inside if len(inside) else allowed
            tokens[i] = int(pool[rng.integers(len(pool))])
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--sizes", default="1,32")
    p.add_argument("--threads", default="2,4,8")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--busy", default="0,1")
    p.add_argument("--schema", default="essay", choices=["essay", "notes"])
    a = p.parse_args()
    tokenizer = load_tokenizer(Path(a.model))
    compiler = ConstraintCompiler(tokenizer)
    vocab = len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else tokenizer.vocab_size
    vocab = max(vocab, compiler.processor(ConstraintSpec.json_schema({})).mask_words * 32)
    quotes = np.zeros(vocab, dtype=bool)
    for t in range(len(tokenizer.vocab)):
        quotes[t] = '"' in tokenizer.decode([t])
    ways = {"inline": GrammarMasks(threads=1)}
    for t in (int(x) for x in a.threads.split(",") if x):
        ways[f"pool{t}"] = GrammarMasks(threads=t, pool_above_s=0)
    for busy in (int(x) for x in a.busy.split(",")):
        stop = threading.Event()
        others = [threading.Thread(target=_busy, args=(stop,), daemon=True) for _ in range(busy)]
        for th in others:
            th.start()
        try:
            for n in (int(x) for x in a.sizes.split(",")):
                for way, masks in ways.items():
                    walk(compiler, masks, n, 8, vocab, quotes, a.schema)  # warm
                    took = sorted(walk(compiler, masks, n, a.steps, vocab, quotes, a.schema))
                    line = {
                        "rows": n,
                        "way": way,
                        "busy_threads": busy,
                        "schema": a.schema,
                        "ms_median": round(statistics.median(took) * 1000, 3),
                        "ms_p90": round(took[int(0.9 * (len(took) - 1))] * 1000, 3),
                        "us_per_row": round(statistics.median(took) * 1e6 / n, 1),
                        "steps": len(took),
                    }
                    print(json.dumps(line), flush=True)
        finally:
            stop.set()
            for th in others:
                th.join()
    for masks in ways.values():
        masks.close()


if __name__ == "__main__":
    main()
