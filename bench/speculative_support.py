"""The pieces of ``bench/speculative.py``: streams through the server's own engine, the
reference tokens (plain greedy decoding, one sequence alone or a batch), the Predicted
Outputs edit, where two answers part and by what margin, and the step costs."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import mlx.core as mx


class RandomDrafts:
    """Drafts random tokens (seeded): next to nothing is accepted, so a run with them
    measures what trying costs."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, random.Random(seed)

    def propose(self, context: list[int], k: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(k)]


@contextlib.contextmanager
def drafting(drafter: Any) -> Iterator[None]:
    """While ``drafter`` is not None, every request the engine speculates for drafts with it."""
    from mlx_server.engine.speculative import batch_runner, runner

    saved = runner.make_drafter
    if drafter is not None:
        fake = lambda *a, **kw: drafter  # noqa: E731
        runner.make_drafter = batch_runner.make_drafter = fake  # type: ignore[assignment]
    try:
        yield
    finally:
        runner.make_drafter = batch_runner.make_drafter = saved


def engine_config(n: int, spec: Any) -> Any:
    """The engine as the server builds it for ``n`` streams (warm-up and prefill buckets
    where kernels are built on first use: CUDA), without the prefix cache."""
    from mlx_server.engine.core.engine import EngineConfig
    from mlx_server.engine.core.tuning import builds_kernels_on_first_use

    jit = builds_kernels_on_first_use()
    return EngineConfig(
        max_batch_size=max(n, 1),
        prompt_cache_size=0,
        warm_up=jit,
        warm_idle_s=0.0,  # the idle pieces (other batch sizes, verify passes) at once
        prefill_buckets=jit,
        lone_decode_keys=2048 if jit else 0,  # the server's idle-time lone decode steps
    )


def streams(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    n: int,
    spec: Any,
    predictions: list[list[int]] | None = None,
) -> dict[str, Any]:
    """``len(prompts)`` greedy streams of ``n`` tokens (EOS ignored) through one engine,
    the server's: decode tokens/s over the window in which every stream decodes (one
    stream: from its first token), also per second of this process's CPU time, the texts
    and the token ids. The requests ask no log-probabilities (reading one per token was a
    sync per token: the kit's plain baseline ran at 435 tok/s on an H100's 1B where the
    server's one stream decodes 516); tokens are counted as the engine delivers them. With
    ``predictions``, each request carries one (OpenAI's Predicted Outputs). One engine at a
    time: its loop has ended before this returns (two engines never run MLX at once)."""
    from mlx_server.engine.core.engine import Engine
    from mlx_server.engine.core.handle import TokenPiece
    from mlx_server.engine.runners.assembly import text_runner
    from mlx_server.engine.speculative.assembly import speculative_runner
    from mlx_server.events import Finished
    from mlx_server.types import GenerationRequest, SamplingParams

    config = engine_config(len(prompts), spec)
    if spec is None:
        runner = text_runner(model, tokenizer, config)
    else:
        runner = speculative_runner(model, tokenizer, config, spec)
    engine = Engine(model, tokenizer, config, runner=runner)
    engine.start()
    if not engine.wait_ready(120):
        raise RuntimeError("the engine did not start")
    # What the server does in idle time before the first requests: the other batch sizes'
    # shapes and the verify passes; none of their builds is timed.
    deadline = time.monotonic() + 300
    while engine.warming_up and time.monotonic() < deadline:
        time.sleep(0.05)

    async def one(i: int, p: list[int]) -> tuple[str, list[tuple[float, int, float]], Any]:
        pred = tuple(predictions[i]) if predictions else ()
        req = GenerationRequest(
            f"s{i}",
            p,
            n,
            SamplingParams(temperature=0.0),
            ignore_eos=True,
            prediction_tokens=pred,
        )
        text = ""
        async for ev in engine.submit(req):
            if isinstance(ev, TokenPiece):
                text += ev.text
            elif isinstance(ev, Finished):
                return text, ev
        raise RuntimeError("no Finished")

    async def run() -> list[Any]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    try:
        with _recording() as delivered:
            results = asyncio.run(run())
    finally:
        engine.shutdown(60)
        if not engine.ended:  # its thread lives on (mlx_threads); its loop must not
            raise RuntimeError("the engine's loop outlived its shutdown")
    # each token as the engine delivered it (the requests ask no log-probabilities, whose
    # per-token reads would slow the server's own fast path, the baseline)
    streams_times = [delivered[f"s{i}"] for i in range(len(prompts))]
    first = max((times[0] for times in streams_times), key=lambda x: x[0])  # last to start
    last = min((times[-1] for times in streams_times), key=lambda x: x[0])  # first to end
    start, end = first[0], last[0]
    count = sum(1 for times in streams_times for t, _, _ in times if start < t <= end)
    cpu = last[1] - first[1]  # this process's CPU seconds meanwhile: steadier when shared
    return {
        "tps": count / (end - start) if end > start else 0.0,
        "cpu_tps": count / cpu if cpu > 0 else 0.0,
        "texts": [text for text, _ in results],
        "tokens": [[tok for _, _, tok in times] for times in streams_times],
        "drafted": sum(f.timings.draft_n for _, f in results if f.timings),
        "accepted": sum(f.timings.draft_n_accepted for _, f in results if f.timings),
    }


@contextlib.contextmanager
def _recording() -> Iterator[dict[str, list[tuple[float, float, int]]]]:
    """Per request id, each token the engine delivers: (wall time, the process's CPU time,
    its id); the engine's events carry text, several tokens to a piece at times."""
    from mlx_server.engine.core import endings

    got: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    deliver = endings.deliver_token

    def recorded(tokenizer: Any, seq: Any, r: Any) -> Any:
        got[seq.req.request_id].append((time.perf_counter(), time.process_time(), int(r.token)))
        return deliver(tokenizer, seq, r)

    endings.deliver_token = recorded
    try:
        yield got
    finally:
        endings.deliver_token = deliver


def no_eos(eos: list[int]) -> Any:
    """Greedy with the end-of-sequence tokens banned: what ``ignore_eos`` decodes."""
    from mlx_server.engine.sampling.samplers import ban_tokens

    ban = ban_tokens(eos)
    return lambda logprobs: mx.argmax(ban(logprobs), axis=-1)


def reference(model: Any, prompts: list[list[int]], n: int, eos: list[int]) -> list[list[int]]:
    """Plain greedy tokens (``ignore_eos``): one prompt on the lone runner's sequence, several
    as one batch of mlx-lm's ``BatchGenerator`` (the server's two plain paths)."""
    from mlx_lm.generate import BatchGenerator

    from mlx_server.engine.runners.base import Insert
    from mlx_server.engine.runners.solo import SoloSequence
    from mlx_server.types import GenerationRequest

    sampler = no_eos(eos)
    if len(prompts) == 1:
        p = prompts[0]
        job = Insert(1, GenerationRequest("ref", p, n), p, 0, None, sampler)
        seq = SoloSequence(model, job, [], 512)
        out: list[int] = []
        while len(out) < n:
            out += [r.token for r in seq.next()[1]]
        return [out[:n]]
    gen = BatchGenerator(model, completion_batch_size=len(prompts), prefill_batch_size=8)
    uids = gen.insert(prompts, max_tokens=[n] * len(prompts), samplers=[sampler] * len(prompts))
    got: dict[int, list[int]] = {u: [] for u in uids}
    while any(len(v) < n for v in got.values()):
        for r in gen.next_generated():
            got[r.uid].append(r.token)
    gen.close()
    return [got[u] for u in uids]


def edited(answer: list[int], vocab: int, span: int = 10) -> list[int]:
    """``answer`` with ``span`` tokens in the middle replaced by others: the prediction a
    code-editing client sends (the old text, one change)."""
    mid = max(0, len(answer) // 2 - span // 2)
    changed = [(t + 7919) % vocab for t in answer[mid : mid + span]]
    return answer[:mid] + changed + answer[mid + span :]


def parting(model: Any, tokenizer: Any, prompt: list[int], ref: list[int], text: str) -> str | None:
    """Where ``text`` parts from the reference tokens' text, and the reference's top-2
    log-probability margin there (one forward over the prompt and the agreed tokens): a
    near-tie (a small margin) is what another kernel's rounding can flip. None: no parting
    within the reference."""
    j, agreed = 0, ""
    while j < len(ref):
        nxt = tokenizer.decode(ref[: j + 1])
        if not text.startswith(nxt):
            break
        agreed, j = nxt, j + 1
    if j == len(ref):
        return None
    from mlx_lm.models.cache import make_prompt_cache

    logits = model(mx.array(prompt + ref[:j])[None], cache=make_prompt_cache(model))[0, -1]
    lp = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32))
    top = mx.argsort(-lp)[:2].tolist()
    a, b = (float(lp[t].item()) for t in top)
    theirs = text[len(agreed) : len(agreed) + 12]
    return (
        f"parts at token {j}: reference {tokenizer.decode([ref[j]])!r}, this run {theirs!r}..., "
        f"top-2 margin {a - b:.4f} ({tokenizer.decode([top[0]])!r} over {tokenizer.decode([top[1]])!r})"
    )


def step_costs(model: Any, prompt: list[int], ks: list[int], batch: int = 1, reps: int = 8) -> dict:
    """Seconds of one forward pass over k + 1 tokens per row after the prompt, for a batch
    of ``batch`` copies of it, for each k (k = 0: a decode step); evaluated each time (not
    pipelined, as a verifying step)."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([prompt] * batch), cache=cache)
    mx.eval([c.state for c in cache])
    out: dict[int, float] = {}
    for k in [0, *ks]:
        times = []
        for _ in range(reps + 1):  # the first compiles the shape: not counted
            t = time.perf_counter()
            mx.eval(model(mx.array([prompt[-(k + 1) :]] * batch), cache=cache))
            times.append(time.perf_counter() - t)
            trim_prompt_cache(cache, k + 1)
        out[k] = sorted(times[1:])[reps // 2]
    return out
