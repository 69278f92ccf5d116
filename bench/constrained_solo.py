"""The grammar's cost per token on the lone-stream path (``SoloSequence``), and how much of
it overlaps the forward pass.

Each round decodes the prompt of ``bench/constrained.py`` greedily on ``SoloSequence``
in turn: ``json_schema`` (the constraint through its processor call every step),
``stepped`` (as the engine's lone runner runs it: stepped after its first token), ``serial``
(the same, but the forward pass is waited for before the mask is computed: no overlap),
and ``free`` (no processor, end-of-sequence ignored, as many tokens as the constrained
run made), and ``plumbing`` (a processor that only reads the newest context token as
the grammar's does, then passes the logits through). A last ``probe`` run times the processor's phases per token: waiting for the
sampled token, consuming it, filling the mask, building the masked logits; then how long
the forward pass still ran after the mask was ready (``device_after_mask``: the part of
the pass the mask work hid behind).

    PYTHONPATH=src:bench .venv/bin/python bench/constrained_solo.py [--model DIR] [--rounds 5]
    PYTHONPATH=src:bench .venv/bin/python bench/constrained_solo.py --stand-in

``--stand-in`` replaces the model by a forward pass of one small matrix product over the
demo model's vocabulary (its tokenizer kept): the step is then mostly host work, as a
small model's is on a fast GPU, and the ratio shows what the grammar adds to the host's
share of a step.

Prints one JSON line per round (ms per token of each mode) and a summary: the median
ratios json_schema / free and serial / free (tokens per second), and the probe's
microseconds per token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
from constrained import DEFAULT_MODELS, SCHEMA, prompt_tokens
from mlx_lm import load as mlx_load
from mlx_lm.sample_utils import make_sampler

from mlx_server.engine.grammar import processor as processor_module
from mlx_server.engine.grammar.constraints import ConstraintCompiler, ConstraintSpec
from mlx_server.engine.grammar.masks import GrammarMasks
from mlx_server.engine.runners.solo import SoloSequence


def decode(
    model: Any,
    prompt: list[int],
    eos: list[int],
    processors: list[Any],
    n: int,
    masks: GrammarMasks | None = None,
):
    """Decode up to ``n`` tokens alone; (tokens, seconds per decoded token after the first).
    ``masks``: the grammar stepped after its first token, as the engine's lone runner does."""
    job = SimpleNamespace(
        uid=0,
        prompt=prompt,
        cached=0,
        cache=None,
        pauses=[],
        sampler=make_sampler(temp=0.0),
        processors=processors,
        request=SimpleNamespace(max_tokens=n, logprobs=False, top_logprobs=0),
    )
    seq = SoloSequence(model, job, eos, prefill_step_size=512, masks=masks)  # type: ignore[arg-type]
    tokens: list[int] = []
    start = 0.0
    while True:
        _, responses = seq.next()
        for r in responses:
            tokens.append(r.token)
            if len(tokens) == 1:
                start = time.perf_counter()
            if r.finish_reason is not None:
                return tokens, (time.perf_counter() - start) / max(1, len(tokens) - 1)


class StandIn:
    """A forward pass of negligible device time: an embedding row times one matrix."""

    def __init__(self, vocab: int, hidden: int = 64):
        mx.random.seed(0)
        self.embed = mx.random.normal((vocab, hidden))
        self.out = mx.random.normal((hidden, vocab))
        mx.eval(self.embed, self.out)

    def make_cache(self) -> list[Any]:
        return []

    def __call__(self, tokens: mx.array, cache: Any = None) -> mx.array:
        return self.embed[tokens] @ self.out


class Plumbing:
    """What the grammar's processor does besides the mask: read the newest context token
    from a slice scheduled before the forward pass; the logits pass through."""

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        tail = tokens[-1:]
        mx.async_eval(tail)
        mx.async_eval(logits)
        tail.tolist()
        return logits


class Serial:
    """The processor, called only once the forward pass has run (no overlap)."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        mx.eval(tokens, logits)
        return self.inner(tokens, logits)


class Probe:
    """The processor with its phases timed (microseconds, one list per phase)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.phases: dict[str, list[float]] = {
            k: [] for k in ("wait_token", "consume", "fill", "apply", "device_after_mask")
        }
        self._mark = 0.0
        timed = self._timed
        inner.consume = timed("consume", inner.consume)
        inner._fill_bitmask = timed("fill", inner._fill_bitmask)
        self._apply = processor_module.apply_bitmask

    def _timed(self, name: str, fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.phases[name].append(1e6 * (time.perf_counter() - start))

        return wrapper

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        waits = self.phases["wait_token"]
        tail = tokens[-1:]
        mx.async_eval(tail)
        mx.async_eval(logits)
        start = time.perf_counter()
        tail.tolist()
        waits.append(1e6 * (time.perf_counter() - start))
        processor_module.apply_bitmask = self._timed("apply", self._apply)
        try:
            out = self.inner(tokens, logits)
        finally:
            processor_module.apply_bitmask = self._apply
        start = time.perf_counter()
        mx.eval(logits)
        self.phases["device_after_mask"].append(1e6 * (time.perf_counter() - start))
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=f"model directory (default: {DEFAULT_MODELS[1]})")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--stand-in", action="store_true", help="a near-free forward pass")
    args = parser.parse_args()
    path = args.model or DEFAULT_MODELS[1]
    model, tokenizer = mlx_load(path)[:2]
    if args.stand_in:
        model = StandIn(len(tokenizer))
        path += " (stand-in forward pass)"
    compiler = ConstraintCompiler(tokenizer)
    spec = ConstraintSpec.json_schema(SCHEMA)
    prompt = prompt_tokens(tokenizer)
    eos = list(tokenizer.eos_token_ids)
    emit({"model": path, "vocab": len(tokenizer), "prompt_tokens": len(prompt)})

    def constrained(wrap: Any = None) -> tuple[list[int], float]:
        p = compiler.processor(spec)
        return decode(model, prompt, eos, [wrap(p) if wrap else p], args.max_tokens)

    reference, _ = constrained()  # warms the lexer and the kernels
    ratios, serial_ratios, plumbing_ratios, stepped_ratios = [], [], [], []
    for i in range(args.rounds):
        out, grammar_s = constrained()
        p = compiler.processor(spec)
        stepped_out, stepped_s = decode(
            model, prompt, eos, [p], args.max_tokens, masks=GrammarMasks(threads=1)
        )
        serial_out, serial_s = constrained(Serial)
        _, free_s = decode(model, prompt, [], [], len(out))
        _, plumbing_s = decode(model, prompt, [], [Plumbing()], len(out))
        assert out == reference == serial_out == stepped_out, "constrained outputs differ"
        ratios.append(free_s / grammar_s)
        serial_ratios.append(free_s / serial_s)
        plumbing_ratios.append(free_s / plumbing_s)
        stepped_ratios.append(free_s / stepped_s)
        emit(
            {
                "round": i,
                "tokens": len(out),
                "json_schema_ms": 1e3 * grammar_s,
                "stepped_ms": 1e3 * stepped_s,
                "serial_ms": 1e3 * serial_s,
                "free_ms": 1e3 * free_s,
                "plumbing_ms": 1e3 * plumbing_s,
            }
        )
    probe = Probe(compiler.processor(spec))
    decode(model, prompt, eos, [probe], args.max_tokens)
    per_token = {f"{k}_us": statistics.median(v) for k, v in probe.phases.items() if v}
    emit(
        {
            "summary": path,
            "json_schema_vs_free": statistics.median(ratios),
            "stepped_vs_free": statistics.median(stepped_ratios),
            "serial_vs_free": statistics.median(serial_ratios),
            "plumbing_vs_free": statistics.median(plumbing_ratios),
            "ratios": [round(r, 3) for r in ratios],
            **{f"median_{k}": v for k, v in per_token.items()},
            "mean_fill_us": statistics.mean(probe.phases["fill"]),
            "max_fill_us": max(probe.phases["fill"]),
        }
    )


def emit(record: dict[str, Any]) -> None:
    rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()}
    print(json.dumps(rounded), flush=True)


if __name__ == "__main__":
    main()
