"""The CPU cost of grammar masks per decode step, for a batch of 1, 8 and 32 sequences.

Each sequence is its own llguidance matcher for the JSON schema of ``bench/constrained.py``
(on the demo model's 49,152-token vocabulary) walking a path of its own (a random allowed
token each step, seeded). Per step it times the masks of every sequence computed

- ``serial``: one after another, as the per-sequence processor does today
  (``unsafe_compute_mask_ptr``, which drops the interpreter lock for each mask), and
- ``parallel``: all at once with llguidance's ``LLExecutor`` (``fill_next_token_bitmask_par``:
  its own threads, outside the interpreter lock, into one batch bitmask).

Consuming the sampled tokens is timed apart (it is the same in both). Applying the masks to
the logits is timed too: per row (unpack, an MLX array and ``where`` for each sequence, as the
processor does) and batched (one bitmask array, one ``where``). Prints one JSON line per batch
size with the median (and 90th percentile) milliseconds per step.

    PYTHONPATH=src:bench .venv/bin/python bench/mask_cost.py [--model DIR] [--steps 60] [--threads N]
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

import llguidance
import llguidance.numpy
import mlx.core as mx
import numpy as np
from constrained import SCHEMA
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlx_server.engine.constraints import ConstraintCompiler, ConstraintSpec


def allowed_ids(mask: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def p90(xs: list[float]) -> float | None:
    return round(sorted(xs)[int(0.9 * (len(xs) - 1))] * 1000, 3) if xs else None


def apply_per_row(bits: np.ndarray, live: list[int], vocab: int) -> float:
    """What the per-sequence processor does with each mask: unpack it, make an MLX array,
    mask that row's logits; the rows are then concatenated."""
    logits = mx.zeros((len(live), vocab))
    mx.eval(logits)
    t = time.perf_counter()
    rows = []
    for j, i in enumerate(live):
        allowed = np.unpackbits(bits[i].view(np.uint8), bitorder="little")[:vocab]
        rows.append(mx.where(mx.array(allowed.view(np.bool_)), logits[j : j + 1], -mx.inf))
    mx.eval(mx.concatenate(rows, axis=0))
    return time.perf_counter() - t


def apply_batched(bits: np.ndarray, live: list[int], vocab: int) -> float:
    """One bitmask array for the batch, expanded and applied in one MLX operation."""
    logits = mx.zeros((len(live), vocab))
    mx.eval(logits)
    t = time.perf_counter()
    words = mx.array(bits[live].view(np.uint32))
    shifts = mx.arange(32, dtype=mx.uint32)
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(len(live), -1)[:, :vocab]
    mx.eval(mx.where(allowed.astype(mx.bool_), logits, -mx.inf))
    return time.perf_counter() - t


def run(compiler: Any, n: int, steps: int, executor: Any, vocab: int) -> dict[str, Any]:
    base = compiler.compile(ConstraintSpec.json_schema(SCHEMA))
    matchers = [base.deep_copy() for _ in range(n)]
    rng = random.Random(n)
    words = (vocab + 31) // 32
    serial_buf = np.zeros((n, words), dtype=np.int32)
    par_buf = np.zeros((n, words), dtype=np.int32)
    serial, parallel, consume, per_row, batched = [], [], [], [], []
    for step in range(steps):
        live = [i for i, m in enumerate(matchers) if not m.is_stopped() and not m.is_error()]
        if not live:
            break
        # Alternate which goes first: the second fill of a state can find llguidance's
        # caches warm.
        for way in ("serial", "parallel") if step % 2 else ("parallel", "serial"):
            t = time.perf_counter()
            if way == "serial":
                for i in live:
                    row = serial_buf[i]
                    matchers[i].unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
                serial.append(time.perf_counter() - t)
            else:
                llguidance.numpy.fill_next_token_bitmask_par(
                    executor, [(matchers[i], i) for i in live], par_buf
                )
                parallel.append(time.perf_counter() - t)
        assert all(np.array_equal(serial_buf[i], par_buf[i]) for i in live)
        per_row.append(apply_per_row(par_buf, live, vocab))
        batched.append(apply_batched(par_buf, live, vocab))
        t = time.perf_counter()
        for i in live:
            ids = allowed_ids(par_buf[i], vocab)
            if len(ids):
                matchers[i].consume_token(int(ids[rng.randrange(len(ids))]))
        consume.append(time.perf_counter() - t)
    ms = lambda xs: round(statistics.median(xs) * 1000, 3) if xs else None  # noqa: E731
    return {
        "bench": "mask_cost",
        "sequences": n,
        "steps": len(serial),
        "serial_ms_per_step": ms(serial),
        "parallel_ms_per_step": ms(parallel),
        "speedup": round(statistics.median(serial) / statistics.median(parallel), 2)
        if serial
        else None,
        "serial_ms_p90": p90(serial),
        "parallel_ms_p90": p90(parallel),
        "apply_per_row_ms_per_step": ms(per_row),
        "apply_batched_ms_per_step": ms(batched),
        "consume_and_pick_ms_per_step": ms(consume),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--sizes", default="1,8,32")
    p.add_argument(
        "--threads", type=int, default=None, help="LLExecutor threads (default: its own)"
    )
    a = p.parse_args()
    tok = load_tokenizer(Path(a.model))
    compiler = ConstraintCompiler(tok)
    vocab = len(tok.vocab)
    executor = llguidance.LLExecutor(a.threads)
    for n in [int(x) for x in a.sizes.split(",")]:
        row = run(compiler, n, a.steps, executor, vocab)
        row.update(cpus=os.cpu_count(), threads=a.threads, vocab=vocab)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
