"""The decode step's graph, op by op: our ``Engine``'s against mlx-lm's ``BatchGenerator``'s.

On a GPU a small model's decode step is bound by launching its kernels, so an op the engine
adds to each step costs there even where it computes nothing much. Both sides decode the
same N distinct prompts greedily to the limit (``BatchGenerator`` without stop tokens, the
engine with ``ignore_eos``); the arrays of one decode step's evaluation (the ``--step``-th
``mx.async_eval`` of N rows) are written with ``mx.export_to_dot`` before they are computed
and their ops counted. The graph is the device's and the model's, not the machine's speed:
this runs the same on a CPU. Prints one JSON line: each side's op count and the ops by kind
that one side has more of.

    PYTHONPATH=src python3 bench/gpu/step_graph.py --model DIR [--streams 8] [--step 4]
        [--max-tokens 12] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import layers  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402


class StepSpy:
    """Stands in for ``mx.async_eval``: the ``step``-th call whose first array has ``rows``
    rows is written as a graph to ``path`` before it is launched."""

    def __init__(self, rows: int, step: int, path: Path):
        self.rows, self.step, self.path = rows, step, path
        self.calls = 0
        self.written = False
        self._real = mx.async_eval

    def __call__(self, *arrays: Any) -> Any:
        flat = _arrays(arrays)
        if flat and flat[0].ndim >= 1 and flat[0].shape[0] == self.rows:
            if self.calls == self.step:
                mx.export_to_dot(str(self.path), *flat)
                self.written = True
            self.calls += 1
        return self._real(*arrays)

    def __enter__(self) -> StepSpy:
        mx.async_eval = self
        return self

    def __exit__(self, *exc: Any) -> None:
        mx.async_eval = self._real


def _arrays(values: Any) -> list[mx.array]:
    out: list[mx.array] = []
    for v in values:
        if isinstance(v, mx.array):
            out.append(v)
        elif isinstance(v, list | tuple):
            out.extend(_arrays(v))
    return out


def ops(path: Path) -> Counter[str]:
    """The ops of a graph ``mx.export_to_dot`` wrote, by kind (inputs are not ops)."""
    return Counter(re.findall(r'\[label ="([^"]+)", shape=rectangle\]', path.read_text()))


def batch_generator_step(model: Any, prompts: list[list[int]], max_tokens: int) -> None:
    gen = BatchGenerator(model, completion_batch_size=len(prompts), prefill_batch_size=len(prompts))
    uids = set(gen.insert(prompts, max_tokens=[max_tokens] * len(prompts)))
    while uids:
        _, responses = gen.next()
        uids -= {r.uid for r in responses if r.finish_reason is not None}
    gen.close()


async def engine_step(model: Any, tok: Any, prompts: list[list[int]], max_tokens: int) -> None:
    engine = layers.make_engine(model, tok, len(prompts))
    engine.start()
    try:
        if hasattr(engine, "wait_ready"):
            await asyncio.to_thread(engine.wait_ready)
        while getattr(engine, "warming_up", False):  # bounded by the warm-up's own pieces
            await asyncio.sleep(0.05)
        with StepSpy(len(prompts), STEP, FOLDER / "engine.dot") as spy:
            await layers.engine_once(engine, prompts, max_tokens, True)
        if not spy.written:
            raise SystemExit(f"the engine took fewer than {STEP + 1} steps")
    finally:
        engine.shutdown()


STEP = 4
FOLDER = Path(".")


def main() -> None:
    global STEP, FOLDER
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--step", type=int, default=4, help="which evaluation of N rows to count")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--dtype", default="", help="cast the weights (e.g. float32 on a CPU)")
    a = p.parse_args()
    STEP = a.step
    model, tok = load(a.model)
    if a.dtype:
        model.set_dtype(getattr(mx, a.dtype))
    with tempfile.TemporaryDirectory() as folder:
        FOLDER = Path(folder)
        prompts = layers.burst_prompts(tok, a.streams, "graph")
        with StepSpy(a.streams, a.step, FOLDER / "batch.dot") as spy:
            batch_generator_step(model, prompts, a.max_tokens)
        if not spy.written:
            raise SystemExit(f"BatchGenerator took fewer than {a.step + 1} steps")
        asyncio.run(
            engine_step(model, tok, layers.burst_prompts(tok, a.streams, "g2"), a.max_tokens)
        )
        theirs, ours = ops(FOLDER / "batch.dot"), ops(FOLDER / "engine.dot")
    print(
        json.dumps(
            {
                "streams": a.streams,
                "step": a.step,
                "batch_generator_ops": sum(theirs.values()),
                "engine_ops": sum(ours.values()),
                "engine_more": dict(ours - theirs),
                "engine_fewer": dict(theirs - ours),
            }
        )
    )


if __name__ == "__main__":
    main()
