"""Constrained against free decoding through the engine (no HTTP), N streams at a time.

For each N (``--streams``) and round, one run per mode (``--modes``) of N concurrent
requests on one model, in an order that rotates each round: ``free`` (``ignore_eos``, so it
runs to ``--max-tokens``), ``batched`` (a ``response_format``-style JSON schema, grammars
masked for the whole batch, the masks filled on a worker thread while the forward pass is
launched: ``BatchRunner(launch_first=False)``), ``launched`` (the same, the pass queued
before the fed tokens are read: ``launch_first=True``; at one stream the fed token read and
the mask filled on the engine's thread after the launch, where ``batched`` has the masks'
worker do it during the launch with cores to spare, or with ``--beside``) and ``per_row`` (the same schema
through mlx-lm's per-row processor calls: ``BatchRunner(batch_grammars=False)``; on the lone
path, one stream, the grammar's processor called every step: ``SoloRunner(step_grammars=False)``)
and ``eager`` (``batched``'s engine with the masks applied in five separate kernels, as
before the compiled graph: ``mask_bits.FUSED = False``; on a CPU both are the host's way) and
``pooled`` (``batched`` with every step's matchers on llguidance's pool of ``--pool-threads``
threads: one call that holds no interpreter lock, where one by one each row takes it again). The schema asks for a string longer
than ``--max-tokens`` can hold, so a constrained answer runs to the limit too. One stream
takes the lone-request path in every mode (its grammar is one per-row processor either way).

Decode tok/s counts every stream's tokens after its first, over the time from the first
stream's first token to the last stream's last one. Prints one JSON line per run and a
summary per N with the median ratios constrained / free.

    PYTHONPATH=src .venv/bin/python bench/constrained_engine.py [--model DIR]
        [--streams 1,8] [--rounds 3] [--max-tokens 64] [--modes free,batched,launched,per_row,eager]
        [--phases]

``--phases`` adds to each run's line where a step's time went, in ms per decode step (any
thread): the masked step (``DecodeStep._masked``) and inside it the forward pass's graph
(``model``), the launches (``mx.async_eval``, free decoding's too), the masks' ``plan``,
``compute`` (inline or on the worker thread), the wait for the worker (``result``) and
``mask``; ``masked_rest`` is what is left of the masked step once the parts timed in it, on
its thread, are out: mostly the read of the fed tokens, the wait for the previous step. One stream runs the lone path: ``solo_forward``
(the step's graph and its grammar), ``solo_emit`` (the read of the token: the wait for the
device), and inside the per-row ``processor`` its ``processor_consume``, ``processor_fill``,
its launches and ``processor_rest`` (the wait for the token it consumes, the mask's graph).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from typing import Any

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import GenerationBatch

from mlx_server.engine.core.engine import Engine, EngineConfig
from mlx_server.engine.core.handle import TokenPiece
from mlx_server.engine.grammar import mask_bits
from mlx_server.engine.grammar.constraints import ConstraintCompiler, ConstraintSpec
from mlx_server.engine.grammar.masks import GrammarMasks
from mlx_server.engine.grammar.processor import GrammarLogitsProcessor
from mlx_server.engine.runners.batch import BatchRunner
from mlx_server.engine.runners.batch_step import DecodeStep
from mlx_server.engine.runners.solo import LoneFirstRunner, SoloRunner, SoloSequence
from mlx_server.events import Finished
from mlx_server.models.base import settle_arrays
from mlx_server.models.cuda_paths import install_cuda_paths
from mlx_server.types import GenerationRequest, SamplingParams

MODES = ("free", "batched", "launched", "per_row", "eager", "pooled")
FILL_BESIDE: bool | None = None  # ``--beside``: True


SPENT: dict[str, float] = defaultdict(float)
# each context's direct children on its own thread (what its ``_rest`` leaves out): a phase
# timed elsewhere (the model's prefill, a result waited for by another thread) is not in it
CHILDREN: dict[str, float] = defaultdict(float)
_LOCK = threading.Lock()
_HERE = threading.local()  # the timed calls under way on this thread, outermost first


def _timed(name: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stack: list[str] = _HERE.__dict__.setdefault("stack", [])
        context = next((n for n in reversed(stack) if n in _CONTEXTS), None)
        label = f"{context} async_eval" if name == "async_eval" and context else name
        parent = stack[-1] if stack else None
        stack.append(name)
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.perf_counter() - t
            stack.pop()
            with _LOCK:
                SPENT[label] += spent
                if parent in _CONTEXTS:
                    CHILDREN[parent] += spent

    return wrapper


_CONTEXTS = ("masked", "processor")  # their own launches are counted apart


def install_phases(model: Any) -> None:
    """Time the masked step's parts (see the module docstring); behaviour unchanged."""
    for owner, name, label in (
        (DecodeStep, "_masked", "masked"),
        (GrammarMasks, "plan", "plan"),
        (GrammarMasks, "compute", "compute"),
        (GrammarMasks, "mask", "mask"),
        (Future, "result", "result"),
        (GenerationBatch, "_step", "decode_step"),
        (type(model), "__call__", "model"),
        # one stream: its grammar is a per-row processor on the lone path
        (SoloSequence, "_forward", "solo_forward"),
        (SoloSequence, "_emit", "solo_emit"),
        (GrammarLogitsProcessor, "__call__", "processor"),
        (GrammarLogitsProcessor, "consume", "processor_consume"),
        (GrammarLogitsProcessor, "_fill_bitmask", "processor_fill"),
    ):
        setattr(owner, name, _timed(label, getattr(owner, name)))
    mx.async_eval = _timed("async_eval", mx.async_eval)
    _time_worker_start()


TIMELINE: list[dict[str, float]] = []  # per step handed to the worker: its moments


def _time_worker_start() -> None:
    """``worker_start``: from a plan's hand-off to the masks' worker thread to its compute
    starting there (the thread's wake-up, and its wait for the interpreter lock). Each
    handed-off step's moments go to ``TIMELINE`` (see ``timeline_ms``)."""
    submit, compute, mask = GrammarMasks.submit, GrammarMasks.compute, GrammarMasks.mask
    result = Future.result

    def submitted(self: GrammarMasks, plan: Any, vocab: int) -> Any:
        plan.submitted_at = time.perf_counter()
        return submit(self, plan, vocab)

    def started(self: GrammarMasks, plan: Any, vocab: int) -> Any:
        at = getattr(plan, "submitted_at", None)
        began = time.perf_counter()
        if at is not None:
            with _LOCK:
                SPENT["worker_start"] += began - at
        try:
            return compute(self, plan, vocab)
        finally:
            plan.compute_at, plan.computed_at = began, time.perf_counter()

    def waited(self: Future, timeout: float | None = None) -> Any:
        _HERE.result_at = time.perf_counter()
        return result(self, timeout)

    def masked(self: GrammarMasks, plan: Any, logits: Any) -> Any:
        at = getattr(plan, "submitted_at", None)
        if at is not None and hasattr(plan, "computed_at"):
            TIMELINE.append(
                {
                    "submit": at,
                    "compute": plan.compute_at,
                    "computed": plan.computed_at,
                    "result": getattr(_HERE, "result_at", at),
                    "resumed": time.perf_counter(),
                }
            )
        return mask(self, plan, logits)

    GrammarMasks.submit = submitted  # type: ignore[method-assign]
    GrammarMasks.compute = started  # type: ignore[method-assign]
    GrammarMasks.mask = masked  # type: ignore[method-assign]
    Future.result = waited  # type: ignore[method-assign]


def timeline_ms() -> dict[str, list[float]]:
    """Median and 90th percentile (ms) over the handed-off steps since the last call, from
    the hand-off: the worker's start (``start``), its compute's end (``done``), the engine
    thread's call for the result, after its launch (``ask``), and its return to the step
    (``back``); ``late``: from the later of done and ask to back (the engine thread's
    wake-up and wait for the lock). Empties ``TIMELINE``."""
    rows, TIMELINE[:] = list(TIMELINE), []
    if not rows:
        return {}
    parts = {
        "start": [r["compute"] - r["submit"] for r in rows],
        "done": [r["computed"] - r["submit"] for r in rows],
        "ask": [r["result"] - r["submit"] for r in rows],
        "back": [r["resumed"] - r["submit"] for r in rows],
        "late": [r["resumed"] - max(r["computed"], r["result"]) for r in rows],
    }
    out = {}
    for k, v in parts.items():
        v = sorted(v)
        out[k] = [
            round(statistics.median(v) * 1000, 3),
            round(v[int(0.9 * (len(v) - 1))] * 1000, 3),
        ]
    return out


def phase_ms(steps: int) -> dict[str, float]:
    """Each phase's ms per decode step; zeroes the totals."""
    with _LOCK:
        spent, children = dict(SPENT), dict(CHILDREN)
        SPENT.clear()
        CHILDREN.clear()
    # what is left of a context once its own timed parts are out: for the masked step
    # mostly the read of the fed tokens, the wait for the previous step; for the processor
    # its wait for the token it consumes and the mask's operations
    for context in _CONTEXTS:
        if context in spent:
            spent[f"{context}_rest"] = spent[context] - children.get(context, 0.0)
    return {k: round(v * 1000 / max(steps, 1), 3) for k, v in sorted(spent.items())}


def essay_schema(max_tokens: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "essay": {"type": "string", "minLength": 8 * max_tokens},
        },
        "required": ["title", "essay"],
        "additionalProperties": False,
    }


def notes_schema(max_tokens: int) -> dict[str, Any]:
    """Strings without a length bound (llguidance's lexer meets the same states again, as
    in most schemas), as many as ``max_tokens`` of them: the array cannot end before the
    limit (each item takes at least two tokens)."""
    return {
        "type": "object",
        "properties": {
            "notes": {"type": "array", "items": {"type": "string"}, "minItems": max_tokens}
        },
        "required": ["notes"],
        "additionalProperties": False,
    }


SCHEMAS = {"essay": essay_schema, "notes": notes_schema}


def make_engine(
    model: Any,
    tokenizer: Any,
    batch_grammars: bool,
    streams: int,
    launch_first: bool = False,
    pool_threads: int | None = None,
) -> Engine:
    eos = sorted(int(t) for t in tokenizer.eos_token_ids)
    step = 512
    batch = BatchRunner(
        model,
        eos,
        max_batch_size=streams,
        prefill_step_size=step,
        keep_caches=False,
        batch_grammars=batch_grammars,
        launch_first=launch_first,
        grammar_masks=None
        if pool_threads is None
        else GrammarMasks(threads=pool_threads, pool_above_s=0),
    )
    # one stream: ``launched`` reads and fills on the engine's thread after the launch, the
    # others where the server would (on the masks' worker during the launch, with cores to
    # spare; ``--beside`` forces it)
    beside = False if launch_first else FILL_BESIDE
    lone = SoloRunner(
        model, eos, prefill_step_size=step, step_grammars=batch_grammars, fill_beside=beside
    )
    runner = LoneFirstRunner(lone, batch)
    config = EngineConfig(
        max_batch_size=streams, prompt_cache_size=0, prefill_step_size=step, kv_bytes_per_token=1
    )
    engine = Engine(model, tokenizer, config, runner=runner)
    engine.start()
    return engine


async def one_run(engine: Engine, reqs: list[GenerationRequest]) -> dict[str, Any]:
    firsts: list[float] = []
    lasts: list[float] = []
    counts: list[int] = []

    async def consume(req: GenerationRequest) -> str:
        handle = engine.submit(req)
        first, reason = 0.0, ""
        async for ev in handle:
            if isinstance(ev, TokenPiece):
                first = first or time.perf_counter()
            elif isinstance(ev, Finished):
                reason = ev.reason
                counts.append(ev.usage.completion_tokens)
        firsts.append(first)
        lasts.append(time.perf_counter())
        return reason

    start = time.perf_counter()
    reasons = await asyncio.gather(*(consume(r) for r in reqs))
    end = time.perf_counter()
    decode = sum(c - 1 for c in counts) / (max(lasts) - min(firsts))
    return {
        "decode_tok_s": decode,
        "aggregate_tok_s": sum(counts) / (end - start),
        "tokens": counts,
        "reasons": sorted(set(reasons)),
    }


def requests(
    tokenizer: Any,
    compiler: ConstraintCompiler,
    mode: str,
    n: int,
    max_tokens: int,
    schema: str = "essay",
):
    reqs = []
    for i in range(n):
        messages = [{"role": "user", "content": f"[{mode} {i}] Reply in JSON: a long essay."}]
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        processors: tuple[Any, ...] = ()
        if mode != "free":
            spec = ConstraintSpec.json_schema(SCHEMAS[schema](max_tokens))
            processors = (compiler.processor(spec),)
        reqs.append(
            GenerationRequest(
                f"{mode}-{i}-{time.monotonic_ns()}",
                prompt,
                max_tokens,
                sampling=SamplingParams(temperature=0.0),
                ignore_eos=mode == "free",
                logits_processors=processors,
            )
        )
    return reqs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct-f32")
    p.add_argument("--streams", default="1,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--phases", action="store_true", help="where each step's time went")
    p.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="the interpreter's thread switch interval in seconds (sys.setswitchinterval; "
        "Python's default 0.005): how long a thread may wait for the lock another holds",
    )
    p.add_argument("--schema", default="essay", choices=sorted(SCHEMAS))
    p.add_argument("--pool-threads", type=int, default=2, help="llguidance's pool in ``pooled``")
    p.add_argument(
        "--beside",
        action="store_true",
        help="one stream's read and fill on the masks' worker whatever the CPU count",
    )
    a = p.parse_args()
    global FILL_BESIDE
    FILL_BESIDE = True if a.beside else None
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    modes = tuple(m for m in MODES if m in a.modes.split(","))
    assert modes[0] == "free", "the ratios are against free decoding"

    model, tokenizer = load(a.model)[:2]
    settle_arrays(model)  # as the server's loader: nothing lazy left for the engine's thread
    install_cuda_paths(model)  # what the server's loader puts in place on a CUDA GPU
    compiler = ConstraintCompiler(tokenizer)
    if a.phases:
        install_phases(model)
    for n in [int(x) for x in a.streams.split(",")]:
        batched = make_engine(model, tokenizer, True, n)
        engines = {"free": batched, "batched": batched, "eager": batched}
        if "launched" in modes:
            engines["launched"] = make_engine(model, tokenizer, True, n, launch_first=True)
        if "pooled" in modes:
            engines["pooled"] = make_engine(model, tokenizer, True, n, pool_threads=a.pool_threads)
        if "per_row" in modes:
            engines["per_row"] = make_engine(model, tokenizer, False, n)
        ratios: dict[str, list[float]] = {m: [] for m in modes if m != "free"}
        try:
            for r in range(a.rounds + 1):  # round 0 warms up, untimed
                k = r % len(modes)
                order = modes[k:] + modes[:k]
                rates = {}
                for mode in order:
                    reqs = requests(tokenizer, compiler, mode, n, a.max_tokens, a.schema)
                    phase_ms(1)  # zero the totals
                    timeline_ms()
                    mask_bits.FUSED = False if mode == "eager" else None
                    res = asyncio.run(one_run(engines[mode], reqs))
                    if a.phases:
                        res["phases_ms_per_step"] = phase_ms(max(res["tokens"], default=1))
                        res["timeline_ms"] = timeline_ms()
                    rates[mode] = res["decode_tok_s"]
                    if r:
                        load_avg = round(os.getloadavg()[0], 1)
                        print(
                            json.dumps(
                                {"streams": n, "round": r, "mode": mode, **res, "load": load_avg}
                            )
                        )
                if r:
                    for mode in ratios:
                        ratios[mode].append(rates[mode] / rates["free"])
        finally:
            for m, engine in engines.items():
                if m not in ("batched", "eager"):  # the same engine as free's
                    engine.shutdown(timeout=10)
        summary = {f"{m}_over_free": round(statistics.median(v), 3) for m, v in ratios.items()}
        spread = {f"{m}_range": [round(min(v), 3), round(max(v), 3)] for m, v in ratios.items()}
        summary.update(spread)
        print(json.dumps({"summary": a.model, "streams": n, **summary}), flush=True)


if __name__ == "__main__":
    main()
