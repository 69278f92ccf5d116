#!/usr/bin/env python3
"""The same work timed at each layer below HTTP, in one process on one model.

Layers: ``mlx_lm.stream_generate`` (one stream); mlx-lm's ``BatchGenerator`` alone (insert N
prompts, call ``next()`` until all are done); this project's ``Engine`` without HTTP (submit N
requests, consume the handles on an asyncio loop, as the server does). Prompts are the ones
``bench_openai.py`` sends (its concurrency and prefix scenarios), chat-templated, greedy.
Each level runs once to warm up (fresh kernels for new shapes) and then timed. The engine's
step-loop phases (``phases.py``) are recorded per level.

``BatchGenerator`` and the ``Engine`` run in interleaved rounds (``--rounds``, alternating
which goes first) at each level, in one process on one device, so that the engine/generator
ratio is taken per round: the rows give each side's median and the median per-round ratio
with its spread (min-max), which is what a 5 % claim is judged by. The engine rows also
give the asyncio thread's CPU time per step (the consumers; it shares the interpreter lock
with the engine thread) and each phase's CPU time beside its wall time.

Prints one JSON line per layer and level (scenario ``layer``) and appends them to --out.

    python3 layers.py --model DIR --label "layers 1b-0" --levels 1,8,32 --out results.jsonl
        [--rounds 5] [--dtype float32] [--switch-interval 0.001]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mlx.core as mx  # noqa: E402
import phases  # noqa: E402
import raw_engine  # noqa: E402
from bench_openai import LONG_PROMPT, TOPICS, make_system_prompt  # noqa: E402
from mlx_lm import load, stream_generate  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

OUT: str | None = None
LABEL = ""
SYSTEM_TOKENS = 1000  # the prefill prompt's system part (bench_openai.py's prefix scenario)


def emit(**row: Any) -> None:
    row = {"scenario": "layer", "label": LABEL, **row}
    row = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}
    line = json.dumps(row, separators=(",", ":"))
    print(line, flush=True)
    if OUT:
        with open(OUT, "a") as f:
            f.write(line + "\n")


def chat_ids(tok: Any, content: str, system: str | None = None) -> list[int]:
    msgs = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": content})
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True))


def burst_prompts(tok: Any, n: int, tag: str) -> list[list[int]]:
    return [
        chat_ids(
            tok,
            f"[{tag} {n}-{i}] Write a long, detailed essay about "
            f"{TOPICS[(i + 3 * n) % len(TOPICS)]}. Use many paragraphs and do not stop early.",
        )
        for i in range(n)
    ]


# ---- layer 1: stream_generate ---------------------------------------------------------------


def stream_once(model: Any, tok: Any, ids: list[int], max_tokens: int) -> dict[str, float]:
    t0 = time.perf_counter()
    t_first = t_last = 0.0
    n = 0
    for _ in stream_generate(model, tok, ids, max_tokens=max_tokens, sampler=make_sampler(0.0)):
        t_last = time.perf_counter()
        t_first = t_first or t_last
        n += 1
    return {
        "ttft_s": t_first - t0,
        "tokens": n,
        "decode_tok_s": (n - 1) / (t_last - t_first) if n > 1 else 0.0,
    }


def compile_probe(model: Any, tok: Any) -> None:
    """Time to first token for prompts of lengths not seen before, then of one seen before:
    MLX's CUDA backend builds some kernels per shape on first use."""
    base = chat_ids(tok, LONG_PROMPT)
    for path in ("stream_generate", "batch_generator"):
        fresh = []
        for extra in range(8):
            ids = base + [base[-1]] * (extra + 3 + (17 if path == "batch_generator" else 0))
            if path == "stream_generate":
                fresh.append(stream_once(model, tok, ids, 2)["ttft_s"])
            else:
                fresh.append(batch_once(model, tok, [ids], 2)["ttft_p95_s"])
        again = (
            stream_once(model, tok, ids, 2)["ttft_s"]
            if path == "stream_generate"
            else batch_once(model, tok, [ids], 2)["ttft_p95_s"]
        )
        emit(layer=path, what="new_lengths", ttft_new_s=fresh, ttft_seen_s=again)


def shape_probe(model: Any, tok: Any, prefix_tokens: int = 1000) -> None:
    """Which shape makes MLX build kernels on first use, for a prompt whose prefix is cached
    (a warm chat turn): the time of one prefill chunk after a cached prefix, (a) for chunk
    lengths not seen before at one prefix length, (b) for one chunk length at prefix lengths
    not seen before, each then once more at a length seen. If only (a) is slow, padding
    chunks to a few bucket lengths (and warming those up) bounds the builds; if (b) is, the
    KV length must be bucketed too."""
    import copy

    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    ids = (chat_ids(tok, make_system_prompt(SYSTEM_TOKENS)) * 4)[:prefix_tokens]
    base = make_prompt_cache(model)
    model(mx.array(ids)[None], cache=base)
    mx.eval([c.state for c in base])

    def chunk_s(n_chunk: int, trim: int) -> float:
        cache = copy.deepcopy(base)
        if trim:
            trim_prompt_cache(cache, trim)
        mx.eval([c.state for c in cache])
        t = time.perf_counter()
        logits = model(mx.array(ids[:n_chunk])[None], cache=cache)
        mx.eval(logits[:, -1, :])
        return time.perf_counter() - t

    chunk_s(24, 0)  # the first call of all: whatever is built once, whatever the shape
    new_len = [chunk_s(n, 0) for n in (17, 19, 21, 23, 25)]
    seen_len = chunk_s(17, 0)
    new_kv = [chunk_s(20, trim) for trim in (1, 3, 5, 7, 9)]
    seen_kv = chunk_s(20, 1)
    emit(
        layer="stream_generate",
        what="shapes",
        prefix_tokens=len(ids),
        new_chunk_len_s=new_len,
        seen_chunk_len_s=seen_len,
        new_prefix_len_s=new_kv,
        seen_prefix_len_s=seen_kv,
    )


# ---- layer 2: BatchGenerator alone --------------------------------------------------------


def batch_once(model: Any, tok: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    n = len(prompts)
    gen = BatchGenerator(
        model,
        completion_batch_size=n,
        prefill_batch_size=n,
        stop_tokens=[[t] for t in tok.eos_token_ids],
    )
    t0 = time.perf_counter()
    uids = gen.insert(prompts, max_tokens=[max_tokens] * n)
    first: dict[int, float] = {}
    tokens = 0
    steps = 0
    left = set(uids)
    while left:
        _, responses = gen.next()
        steps += 1
        now = time.perf_counter()
        for r in responses:
            first.setdefault(r.uid, now)
            tokens += 1
            if r.finish_reason is not None:
                left.discard(r.uid)
    t_end = time.perf_counter()
    gen.close()
    all_started = max(first.values())
    ttfts = sorted(t - t0 for t in first.values())
    return {
        "aggregate_tok_s": tokens / (t_end - t0),
        "decode_tok_s": (tokens - n) / (t_end - all_started) if t_end > all_started else 0.0,
        "step_ms": (t_end - all_started) * 1000 / max(1, steps - 1),
        "ttft_p95_s": ttfts[int(0.95 * (len(ttfts) - 1))],
        "tokens": tokens,
    }


# ---- layer 3: the Engine without HTTP ------------------------------------------------------


async def engine_once(
    engine: Any, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False
) -> dict[str, float]:
    from mlx_server.engine.core.handle import TokenPiece
    from mlx_server.types import GenerationRequest, SamplingParams

    loop = asyncio.get_running_loop()
    # Announced first, as the chat service announces each request before it builds it: the
    # burst then starts as one prefill wave, however the engine's thread is scheduled
    # between the submissions (the fourth session's H100 run, without this: 1.4 waves a
    # round at 32 streams).
    ids_of = [uuid.uuid4().hex for _ in prompts]
    expect = getattr(engine, "expect", None)  # an engine that gathers bursts
    if expect is not None:
        for rid in ids_of:
            expect(rid)
    names = iter(ids_of)

    async def one(ids: list[int]) -> tuple[float, float, int]:
        req = GenerationRequest(
            request_id=next(names),
            prompt_tokens=ids,
            max_tokens=max_tokens,
            sampling=SamplingParams(temperature=0.0),
            **({"ignore_eos": True} if ignore_eos else {}),
        )
        h = engine.submit(req, loop)
        t_first = 0.0
        n = 0
        async for ev in h:
            if isinstance(ev, TokenPiece):
                t_first = t_first or time.perf_counter()
            elif hasattr(ev, "usage"):  # Finished (the start event carries no usage)
                n = ev.usage.completion_tokens
                if ev.timings is not None and n:
                    # The first token's time from the engine's own clock: a piece is
                    # pushed only once it has text, and a random-weight model's text
                    # can be held back to the end (an unfinished character, special
                    # tokens), which made one round's decode rate read 34 million tok/s.
                    t_first = time.perf_counter() - ev.timings.predicted_ms / 1000
        return t_first, time.perf_counter(), n

    t0, c0 = time.perf_counter(), time.thread_time()
    res = await asyncio.gather(*[one(p) for p in prompts])
    main_cpu_s = time.thread_time() - c0
    t_end = max(r[1] for r in res)
    tokens = sum(r[2] for r in res)
    all_started = max(r[0] for r in res)
    ttfts = sorted(r[0] - t0 for r in res)
    return {
        "aggregate_tok_s": tokens / (t_end - t0),
        "decode_tok_s": (tokens - len(prompts)) / (t_end - all_started)
        if t_end > all_started
        else 0.0,
        "ttft_p95_s": ttfts[int(0.95 * (len(ttfts) - 1))],
        "tokens": tokens,
        "main_cpu_s": main_cpu_s,
    }


def phase_summary(snap: dict[str, Any], tokens: int) -> dict[str, Any]:
    # The batch's steps; one stream runs on the lone runner, which has no ``gen.next``: the
    # engine's steps then (per "step" its whole run's totals read 1.8 s at N = 1 before).
    steps = snap.get("gen.next", {}).get("n", 0) or snap.get("engine._step", {}).get("n", 0)
    steps = max(1, steps)
    out: dict[str, Any] = {"steps": steps}
    for k, v in snap.items():
        out[k] = {
            "s": v["s"],
            "n": v["n"],
            "ms_per_step": round(v["s"] * 1000 / steps, 4),
            "cpu_ms_per_step": round(v.get("cpu_s", 0.0) * 1000 / steps, 4),
        }
    out["tokens"] = tokens
    return out


def spread(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


async def level(engine: Any, model: Any, tok: Any, a: argparse.Namespace, n: int) -> None:
    """One level: ``a.rounds`` rounds of the engine and (unless skipped) BatchGenerator
    alone, alternating which goes first, each after a warm-up of both."""
    with_batch = "batch" not in a.skip_set
    await engine_once(engine, burst_prompts(tok, n, "warm"), 16)
    if with_batch:
        batch_once(model, tok, burst_prompts(tok, n, "warm"), 16)
    ours, theirs = [], []
    phases.reset()
    wall = 0.0
    for r in range(a.rounds):
        # Prompts of their own each round: a round repeating the last one's would be served
        # from the prefix cache (one token to prefill, new cached lengths), not the same work.
        prompts = burst_prompts(tok, n, f"request {r}")
        if with_batch and r % 2 == 0:
            theirs.append(batch_once(model, tok, prompts, a.max_tokens))
        t = time.perf_counter()
        ours.append(await engine_once(engine, prompts, a.max_tokens))
        wall += time.perf_counter() - t
        if with_batch and r % 2 == 1:
            theirs.append(batch_once(model, tok, prompts, a.max_tokens))
    snap = phases.snapshot()
    med = lambda rows, k: statistics.median(x[k] for x in rows)  # noqa: E731
    if theirs:
        emit(
            layer="batch_generator",
            n=n,
            **{k: med(theirs, k) for k in theirs[0]},
            rounds=a.rounds,
            decode_tok_s_rounds=spread([x["decode_tok_s"] for x in theirs]),
        )
    tokens = sum(x["tokens"] for x in ours)
    summary = phase_summary(snap, tokens)
    row: dict[str, Any] = {k: med(ours, k) for k in ours[0]}
    row["main_cpu_ms_per_step"] = sum(x["main_cpu_s"] for x in ours) * 1000 / summary["steps"]
    row["decode_tok_s_rounds"] = spread([x["decode_tok_s"] for x in ours])
    if theirs:
        row["decode_ratio_per_round"] = spread(
            [o["decode_tok_s"] / t["decode_tok_s"] for o, t in zip(ours, theirs, strict=True)]
        )
        row["aggregate_ratio_per_round"] = spread(
            [o["aggregate_tok_s"] / t["aggregate_tok_s"] for o, t in zip(ours, theirs, strict=True)]
        )
    emit(layer="engine", n=n, wall_s=wall / a.rounds, rounds=a.rounds, **row, phases=summary)


def make_engine(model: Any, tok: Any, max_batch: int, **extra: Any) -> Any:
    """An ``Engine`` configured as the server configures one on this device (``extra``: more
    ``EngineConfig`` fields), not yet started. The server's CUDA paths go in first, as its
    loader puts them in (on a CUDA GPU; elsewhere nothing changes): without them a short
    chunk after a cached prefix, a warm turn, built a cuDNN graph the server never builds
    (the first round's warm turn read 63-74 ms on the 1B, the next 13-15). And every array
    the model holds is computed here, as the loader does: a lazy one (``--dtype``'s cast, a
    RoPE's frequencies) left for the engine's thread fails there ("There is no Stream(cpu,
    0) in current thread": MLX's streams are per thread)."""
    from mlx_server.engine.core.engine import Engine, EngineConfig

    try:
        from mlx_server.models.base import settle_arrays
        from mlx_server.models.cuda_paths import install_cuda_paths

        settle_arrays(model)
        install_cuda_paths(model)
    except ImportError:  # a version of the server from before them
        pass

    kw: dict[str, Any] = {"max_batch_size": max_batch, "kv_budget_bytes": 64 << 30, **extra}
    try:  # the server's device-sized defaults, where this version of the engine has them
        from mlx_server.engine.core.tuning import builds_kernels_on_first_use, default_prefill_step

        kw.update(prefill_step_size=default_prefill_step(), warm_up=True)
        if "prefill_buckets" in EngineConfig.__dataclass_fields__:  # as the server sets it
            kw["prefill_buckets"] = builds_kernels_on_first_use()
        if "lone_decode_keys" in EngineConfig.__dataclass_fields__:  # its idle-time pieces
            kw["lone_decode_keys"] = 2048 if builds_kernels_on_first_use() else 0
    except ImportError:
        pass
    cfg = EngineConfig(**kw)
    try:  # the runner start-up builds, where this version of the engine takes one
        from mlx_server.engine.runners.assembly import text_runner

        return Engine(model, tok, cfg, runner=text_runner(model, tok, cfg))
    except ImportError:
        return Engine(model, tok, cfg)


async def engine_layer(model: Any, tok: Any, a: argparse.Namespace) -> None:
    engine = make_engine(model, tok, max(a.levels))
    engine.start()
    t_ready = time.perf_counter()
    if hasattr(engine, "wait_ready"):  # an engine that warms up before it serves
        await asyncio.to_thread(engine.wait_ready)
    emit(layer="engine", what="ready_s", value=time.perf_counter() - t_ready)
    deadline = time.perf_counter() + 120
    while getattr(engine, "warming_up", False) and time.perf_counter() < deadline:
        await asyncio.sleep(0.05)  # the rest of the warm-up, run while idle
    emit(layer="engine", what="warm_s", value=time.perf_counter() - t_ready)
    try:
        # The first burst, before anything has run: kernels for new shapes are compiled here.
        first = await engine_once(engine, burst_prompts(tok, 8, "first"), 32)
        emit(layer="engine", what="first_burst", n=8, **first)
        for n in a.levels:
            await level(engine, model, tok, a, n)
        # Prefill: a cold ~1,150-token prompt, then the same conversation one turn later.
        system = make_system_prompt(SYSTEM_TOKENS)
        for i in range(2):
            ids = chat_ids(
                tok, "Which rule mentions a refund? Answer briefly.", f"Session {i:08x}.\n{system}"
            )
            phases.reset()
            cold = await engine_once(engine, [ids], 1)
            msgs = [
                {"role": "system", "content": f"Session {i:08x}.\n{system}"},
                {"role": "user", "content": "Which rule mentions a refund? Answer briefly."},
                {"role": "assistant", "content": "Rule 12."},
                {"role": "user", "content": "Summarise rule 3 in one sentence."},
            ]
            warm_ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True))
            warm = await engine_once(engine, [warm_ids], 1)
            emit(
                layer="engine",
                what="prefill",
                prompt_tokens=len(ids),
                cold_ttft_s=cold["ttft_p95_s"],
                warm_prompt_tokens=len(warm_ids),
                warm_ttft_s=warm["ttft_p95_s"],
                phases=phases.snapshot(),
            )
    finally:
        engine.shutdown()


def main() -> int:
    global OUT, LABEL, SYSTEM_TOKENS
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--label", default="")
    p.add_argument("--levels", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--single-tokens", type=int, default=256)
    p.add_argument("--skip", default="", help="parts to skip: stream,compile,shapes,batch,engine")
    p.add_argument("--system-tokens", type=int, default=SYSTEM_TOKENS)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per level")
    p.add_argument("--dtype", default="", help="cast the weights (e.g. float32 on a CPU)")
    p.add_argument(
        "--switch-interval",
        type=float,
        default=0.0,
        help="sys.setswitchinterval for the whole run (0: Python's default, 5 ms)",
    )
    p.add_argument("--out")
    a = p.parse_args()
    OUT, LABEL, SYSTEM_TOKENS = a.out, a.label, a.system_tokens
    if a.switch_interval:
        sys.setswitchinterval(a.switch_interval)
    phases.install()
    t = time.perf_counter()
    model, tok = load(a.model)
    if a.dtype:
        model.set_dtype(getattr(mx, a.dtype))
    emit(layer="load", value=time.perf_counter() - t)
    skip = a.skip_set = set(a.skip.split(","))

    if "stream" not in skip:
        # The raw engine's own baseline, measured exactly as raw_engine.py does (same
        # prompt, length, warm-up and repeats), so the two scripts' figures agree.
        for ignore_eos in (False, True):
            base = raw_engine.baseline(model, tok, a.single_tokens, 3, ignore_eos)
            emit(layer="stream_generate", n=1, ignore_eos=ignore_eos, **base)
        long_ids = chat_ids(
            tok,
            "Which rule mentions a refund? Answer briefly.",
            "Session 00000000.\n" + make_system_prompt(SYSTEM_TOKENS),
        )
        pre = [stream_once(model, tok, long_ids, 1) for _ in range(3)]
        emit(
            layer="stream_generate",
            what="prefill",
            prompt_tokens=len(long_ids),
            ttft_s=sorted(r["ttft_s"] for r in pre)[1],
        )

    if "compile" not in skip:
        compile_probe(model, tok)
    if "shapes" not in skip:
        shape_probe(model, tok)

    if "batch" not in skip and "engine" in skip:  # else interleaved with the engine's rounds
        for n in a.levels:
            batch_once(model, tok, burst_prompts(tok, n, "warm"), 16)
            r = batch_once(model, tok, burst_prompts(tok, n, "request"), a.max_tokens)
            emit(layer="batch_generator", n=n, **r)

    if "engine" not in skip:
        asyncio.run(engine_layer(model, tok, a))
    mx.synchronize()
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown while the engine thread's MLX state is alive


if __name__ == "__main__":
    sys.exit(main())
