"""The batch runner's decode step with mixed sampling settings: mlx-lm's row-by-row step
(``BatchRunner(by_group=False)``) against the grouped one (``runners/batch_step.py``).

N sequences decode together, each with the settings of its mix (``greedy``: all greedy;
``twotemps``: greedy and 0.8 alternating; ``mixed``: greedy, 0.7, 0.7 seeded, greedy with a
repetition penalty; ``penalty1``: all greedy, one with a repetition penalty), in
interleaved rounds. Per step, once every sequence decodes: the engine thread's CPU time
(what Python and the launches cost; robust to a shared machine) and the wall time. Prints
one line per N with both medians and the median per-round ratio grouped / row by row with
its spread.

    PYTHONPATH=src .venv/bin/python bench/batch_step.py --model DIR [--sizes 8,32]
        [--tokens 96] [--rounds 5] [--mix twotemps]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from mlx_lm import load

from mlx_server.engine.runners.batch import BatchRunner
from mlx_server.engine.sampling.samplers import SamplerPool, sequence_sampling
from mlx_server.types import GenerationRequest, SamplingParams

MIXES = {
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "twotemps": lambda i: SamplingParams(temperature=0.0 if i % 2 else 0.8),
    "mixed": lambda i: [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.7, seed=i),
        SamplingParams(temperature=0.0, repetition_penalty=1.1),
    ][i % 4],
    "penalty1": lambda i: SamplingParams(
        temperature=0.0, repetition_penalty=1.1 if i == 0 else None
    ),
}


class _Seq:
    fault: str | None = None
    shared: Any = None


def run(model: Any, n: int, tokens: int, mix: str, by_group: bool) -> tuple[float, float]:
    """(CPU ms, wall ms) per step once all ``n`` sequences decode."""
    runner = BatchRunner(model, [], max_batch_size=n, prefill_step_size=512, by_group=by_group)
    pool, vocab = SamplerPool(), model.args.vocab_size
    for i in range(n):
        prompt = [1 + (i * 7 + j) % 300 for j in range(40)]
        req = GenerationRequest(
            request_id=str(i), prompt_tokens=prompt, max_tokens=tokens, sampling=MIXES[mix](i)
        )
        sampler, processors = sequence_sampling(_Seq(), req, pool, vocab, [])
        runner.join(i, [prompt], None, [], tokens, sampler, processors)
    steps, c0, w0 = 0, 0.0, 0.0
    while len(runner):
        responses = runner.step()[1]
        if len(responses) == n and not steps:
            c0, w0 = time.thread_time(), time.perf_counter()
        if c0:
            steps += 1
    c, w = time.thread_time() - c0, time.perf_counter() - w0
    runner.close()
    return c * 1000 / max(1, steps), w * 1000 / max(1, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct-f32")
    p.add_argument("--sizes", default="8,32")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mix", default="twotemps", choices=sorted(MIXES))
    a = p.parse_args()
    model = load(a.model)[0]
    sizes = [int(x) for x in a.sizes.split(",")]
    got: dict[tuple[int, bool], list[tuple[float, float]]] = {}
    for r in range(a.rounds):
        for n in sizes:
            for by_group in (r % 2 == 0, r % 2 == 1):  # alternate which goes first
                got.setdefault((n, by_group), []).append(run(model, n, a.tokens, a.mix, by_group))
    for n in sizes:
        rows, grouped = got[(n, False)], got[(n, True)]
        ratio = sorted(g[0] / r[0] for r, g in zip(rows, grouped, strict=True))
        med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
        print(
            f"{a.mix} N={n}: engine-thread CPU ms/step row by row {med(rows, 0):.2f}, "
            f"grouped {med(grouped, 0):.2f}, ratio per round {statistics.median(ratio):.2f} "
            f"({ratio[0]:.2f}-{ratio[-1]:.2f}); wall ms/step {med(rows, 1):.2f} vs "
            f"{med(grouped, 1):.2f}"
        )


if __name__ == "__main__":
    main()
