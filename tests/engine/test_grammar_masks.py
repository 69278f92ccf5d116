"""Grammar masks for a whole batch in one call (``GrammarMasks``, the batch runner's path).

The batched masks must be exactly the per-sequence processor's (the way before them) and
llguidance's own, rows without a grammar untouched, and one broken grammar must end only its
own request. The tiny random-weight model of ``test_constraints`` makes every JSON output
here the constraint's doing.
"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
import pytest
from engine_runner import drive, generate_all, request
from mlx_lm.tokenizer_utils import TokenizerWrapper
from test_constraints import SCHEMAS, make_hf_tokenizer, make_model

from mlx_server.engine.core.engine import Engine, EngineConfig
from mlx_server.engine.grammar import mask_bits
from mlx_server.engine.grammar.constraints import ConstraintCompiler, ConstraintSpec, build_grammar
from mlx_server.engine.grammar.mask_bits import masked_on_device, unpack_on_device, unpack_on_host
from mlx_server.engine.grammar.masks import (
    POOL_ABOVE_S,
    PROBE_EVERY,
    BatchGrammar,
    GrammarMasks,
)
from mlx_server.engine.grammar.processor import GrammarLogitsProcessor
from mlx_server.engine.runners.batch import BatchRunner
from mlx_server.types import SamplingParams


@pytest.fixture(scope="module")
def tokenizer() -> TokenizerWrapper:
    return TokenizerWrapper(make_hf_tokenizer())


@pytest.fixture(scope="module")
def model(tokenizer: TokenizerWrapper) -> Any:
    return make_model(len(tokenizer))


@pytest.fixture(scope="module")
def compiler(tokenizer: TokenizerWrapper) -> ConstraintCompiler:
    return ConstraintCompiler(tokenizer)


@pytest.mark.parametrize("vocab", [150, 160, 200])
def test_host_and_device_unpacking_agree(vocab):
    rng = np.random.default_rng(vocab)
    words = rng.integers(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), dtype=np.int64)
    words = words.astype(np.int32)
    host, device = unpack_on_host(words, vocab), unpack_on_device(words, vocab)
    assert host.shape == (3, vocab) and host.dtype == mx.bool_
    assert mx.array_equal(host, device).item()
    logits = mx.array(rng.normal(size=(3, vocab)).astype(np.float32))
    for dtype in (mx.float32, mx.bfloat16):
        eager = mx.where(host, logits.astype(dtype), -float("inf"))
        graph = masked_on_device(logits.astype(dtype), words)
        assert graph.dtype == dtype and mx.array_equal(graph, eager).item()
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    assert np.array_equal(np.array(host), bits.astype(bool))


def reference_allowed(matcher: llguidance.LLMatcher, vocab: int) -> set[int]:
    """What llguidance itself allows next, read from its own bitmask."""
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return {int(t) for t in np.flatnonzero(np.unpackbits(bits, bitorder="little")) if t < vocab}


@pytest.mark.parametrize(("threads", "fused"), [(1, False), (2, False), (1, True)])
def test_batched_masks_are_the_per_row_masks_and_llguidance_s(
    tokenizer, compiler, threads, fused, monkeypatch
):
    """Rows: four schemas, a row without a grammar, and one that activates after a trigger.
    Each step every row takes a random allowed token (the trigger row its trigger at step
    3); the batch's masked logits equal the per-row processor's on a twin, row by row,
    and allow what a third copy of the matcher allows. ``fused``: the masks applied as
    one compiled graph over the whole batch (a GPU's way), here on the CPU."""
    monkeypatch.setattr(mask_bits, "FUSED", fused)
    vocab = len(tokenizer) + 5  # the model's logits are wider than the tokenizer
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    specs = [ConstraintSpec.json_schema(s) for s in SCHEMAS] + [None, ConstraintSpec.json_object()]
    triggers = [None] * 5 + [[think_end]]

    def make(i: int) -> GrammarLogitsProcessor | None:
        spec = specs[i]
        return None if spec is None else compiler.processor(spec, activate_after=triggers[i])

    batched = [make(i) for i in range(len(specs))]
    per_row = [make(i) for i in range(len(specs))]
    refs = [compiler.compile(s).deep_copy() if s is not None else None for s in specs]
    masks = GrammarMasks(threads=threads, pool_above_s=0.0)  # two threads: always the pool
    rng = random.Random(threads)
    contexts = [tokenizer.encode("Answer:") for _ in specs]
    ended = [False] * len(specs)
    for step in range(300):
        logits = mx.array(np.random.default_rng(step).normal(size=(len(specs), vocab)))
        logits = logits.astype(mx.float32)
        rows = [BatchGrammar(p) if p is not None else None for p in batched]
        out = masks.apply(rows, [c[-1] for c in contexts], logits)
        for i, p in enumerate(per_row):
            if p is None:
                assert mx.array_equal(out[i], logits[i]).item()  # no grammar: untouched
                continue
            expected = p(mx.array(contexts[i]), logits[i : i + 1])[0]
            assert mx.array_equal(out[i], expected).item(), (step, i)
            allowed = set(np.flatnonzero(np.array(out[i]) > -np.inf).tolist())
            grammar_on = p.active
            if grammar_on and not ended[i]:
                assert allowed == reference_allowed(refs[i], vocab), (step, i)
        if all(ended[i] or specs[i] is None for i in range(len(specs))):
            break
        for i in range(len(specs)):
            allowed = np.flatnonzero(np.array(out[i]) > -np.inf).tolist()
            if i == 5 and step == 3:
                token = think_end
            elif i == 5 and step < 3:
                token = rng.choice([t for t in allowed if t != think_end])
            else:
                token = rng.choice(allowed)
            contexts[i].append(token)
            ref = refs[i]
            if ref is not None and not ended[i] and (i != 5 or step > 3):
                if ref.is_stopped():
                    ended[i] = True
                else:
                    assert ref.consume_token(token)
    assert all(ended[i] for i in range(5) if specs[i] is not None)
    assert masks.pooled == (masks.steps if threads > 1 else 0) and masks.steps > 10
    assert batched[5] is not None and batched[5].active and batched[5].consumed > 0
    for p in batched:
        assert p is None or p.error is None


@pytest.mark.parametrize(
    ("alone_ms", "pool_ms", "pooled"),
    [
        (0.1, 0.01, 0),  # 4 rows one by one: 0.4 ms a step, under the bar: never the pool
        (1.0, 0.1, PROBE_EVERY + 1),  # over it, the pool faster: all but the first and a probe
        (1.0, 3.0, 2),  # over it, the pool slower: tried once, then once in a probe
    ],
)
def test_the_pool_runs_the_matchers_only_where_measured_to_pay(
    monkeypatch, tokenizer, compiler, alone_ms, pool_ms, pooled
):
    """llguidance's pool wakes its threads each step, which costs more than most grammars'
    fills (microseconds a row): the matchers run one by one, timed, and above
    ``pool_above_s`` a step the pool is tried and kept only where it is measured faster,
    the other way probed every ``PROBE_EVERY`` steps. Each fill's cost is set on a fake
    clock (per row, by the way it runs)."""
    from types import SimpleNamespace

    import mlx_server.engine.grammar.masks as masks_module

    clock = SimpleNamespace(t=0.0)
    monkeypatch.setattr(masks_module, "time", SimpleNamespace(perf_counter=lambda: clock.t))
    real_fill = GrammarMasks._fill

    def fill(self: GrammarMasks, grammars: list[BatchGrammar], width: int, pool: bool) -> Any:
        clock.t += len(grammars) * (pool_ms if pool else alone_ms) / 1000
        return real_fill(self, grammars, width, pool)

    monkeypatch.setattr(GrammarMasks, "_fill", fill)
    vocab, steps = len(tokenizer), PROBE_EVERY + 3
    masks = GrammarMasks(threads=2, pool_above_s=0.002)
    rows = [BatchGrammar(compiler.processor(ConstraintSpec.json_object())) for _ in range(4)]
    rng = random.Random(7)
    tokens = [0] * len(rows)  # the prompt's last token: not consumed
    for _ in range(steps):
        out = masks.apply(rows, tokens, mx.zeros((len(rows), vocab)))
        allowed = [np.flatnonzero(np.array(row) > -np.inf).tolist() for row in out]
        tokens = [rng.choice(a) for a in allowed]
    assert all(not g.failed and g.processor.error is None for g in rows)
    assert masks.steps == steps and masks.pooled == pooled


def test_the_pool_is_sized_by_the_cpus_this_process_may_use(monkeypatch):
    """A container (or ``taskset``) allows fewer CPUs than the machine has: a pool sized by
    the machine's count would run more threads than CPUs."""
    import mlx_server.engine.core.cpus as cpus
    import mlx_server.engine.grammar.masks as masks_module

    monkeypatch.setattr(cpus.os, "cpu_count", lambda: 192)
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(10)), False)
    assert cpus.usable_cpus() == 10 and masks_module.default_threads() == 8
    monkeypatch.delattr(cpus.os, "sched_getaffinity")  # as on macOS
    assert cpus.usable_cpus() == 192 and masks_module.default_threads() == 32


def engine_with(model: Any, tokenizer: Any, **runner: Any) -> Engine:
    batch = BatchRunner(
        model,
        sorted(tokenizer.eos_token_ids),
        max_batch_size=8,
        prefill_step_size=64,
        keep_caches=False,
        **runner,
    )
    config = EngineConfig(max_batch_size=8, prompt_cache_size=0, kv_bytes_per_token=256)
    engine = Engine(model, tokenizer, config, runner=batch)
    engine.start()
    return engine


def mixed_requests(tokenizer: Any, compiler: ConstraintCompiler) -> list[Any]:
    """Four schemas and two free requests, each seeded (its own random stream)."""
    prompt = tokenizer.encode("Answer in JSON:")
    reqs = []
    for i, schema in enumerate(SCHEMAS[:2] + [None] + SCHEMAS[2:] + [None]):
        processors = (
            () if schema is None else (compiler.processor(ConstraintSpec.json_schema(schema)),)
        )
        sampling = SamplingParams(temperature=1.0, seed=100 + i)
        reqs.append(
            request(
                prompt,
                600 if schema else 40,
                sampling=sampling,
                logits_processors=processors,
                ignore_eos=schema is None,
            )
        )
    return reqs


def test_a_mixed_batch_gives_valid_json_and_the_per_row_path_s_tokens(model, tokenizer, compiler):
    """The batch path (masks computed inline after the launch with one thread, on the
    worker thread with two, or after queueing the pass before reading the fed tokens:
    ``launch_first``) and the per-row path give the same tokens, the constrained ones
    valid JSON that ends at the grammar's end."""
    schemas = SCHEMAS[:2] + [None] + SCHEMAS[2:] + [None]
    runs = {
        "per_row": (False, 1, False),
        "inline": (True, 1, False),
        "worker": (True, 2, False),
        "pooled": (True, 2, False),
        "launched": (True, 2, True),
    }
    outputs, masks = {}, {}
    for name, (batched, threads, first) in runs.items():
        # "pooled": the matchers always on llguidance's pool; elsewhere as measured (these
        # small grammars: one by one)
        above = 0.0 if name == "pooled" else POOL_ABOVE_S
        masks[name] = GrammarMasks(threads=threads, pool_above_s=above)
        assert masks[name].overlap == (threads > 1)
        engine = engine_with(
            model,
            tokenizer,
            batch_grammars=batched,
            grammar_masks=masks[name],
            launch_first=first,
        )
        try:
            outputs[name] = drive(engine, generate_all(engine, mixed_requests(tokenizer, compiler)))
        finally:
            engine.shutdown(timeout=10)
    assert masks["per_row"].steps == 0  # mlx-lm's per-row calls did all the masking
    # The worker thread fills while the pass is launched; launched first, the fill is inline.
    assert masks["worker"].submitted > 10 and masks["launched"].submitted == 0
    assert masks["pooled"].pooled > 10  # (elsewhere the choice is timed: not asserted)
    for name in ("inline", "worker", "pooled", "launched"):
        assert masks[name].steps > 10 and masks[name].rows > 2 * masks[name].steps
        for new, old, schema in zip(outputs[name], outputs["per_row"], schemas, strict=True):
            assert (new.text, new.reason) == (old.text, old.reason), name
            assert new.finished.usage.completion_tokens == old.finished.usage.completion_tokens
            if schema is not None:
                assert new.reason == "stop", new.text
                jsonschema.validate(json.loads(new.text), schema)
    free = [r for r, s in zip(outputs["worker"], schemas, strict=True) if s is None]
    assert all(r.reason == "length" for r in free)  # random weights: no JSON, no early end


class Exploding(GrammarLogitsProcessor):
    """A grammar whose step fails after a few tokens (as a bug in it would)."""

    def observe(self, token: int) -> int | None:
        if self.consumed >= 3:
            raise RuntimeError("grammar exploded")
        return super().observe(token)


class Misfit(GrammarLogitsProcessor):
    """After two tokens its matcher is swapped for one over a wider vocabulary, so the
    batch's one fill call refuses it (the buffer is one width for all rows)."""

    other: llguidance.LLMatcher

    def record(self, token: int, ok: bool) -> None:
        super().record(token, ok)
        if self.consumed == 2:
            self.matcher = self.other


def test_a_broken_grammar_ends_only_its_own_request(model, tokenizer, compiler):
    """In one batch: a grammar whose step raises (that request fails, with its error), a
    matcher broken from the start (only end-of-sequence allowed: it stops at once), one
    whose mask the batch's fill call refuses (that request fails), and two sound schemas
    (valid JSON)."""
    obj = ConstraintSpec.json_object()
    eos = compiler.processor(obj).eos_ids
    exploding = Exploding(compiler.compile(obj).deep_copy(), mask_vocab=len(tokenizer), eos_ids=eos)
    broken = GrammarLogitsProcessor(
        llguidance.LLMatcher(compiler._tokenizer, "start: nope_undefined", log_level=0),
        mask_vocab=len(tokenizer),
        eos_ids=eos,
    )
    misfit = Misfit(compiler.compile(obj).deep_copy(), mask_vocab=len(tokenizer), eos_ids=eos)
    wider = llguidance.hf.from_tokenizer(tokenizer._tokenizer, n_vocab=len(tokenizer) + 64)
    misfit.other = llguidance.LLMatcher(wider, build_grammar(obj), log_level=0)
    sound = [compiler.processor(ConstraintSpec.json_schema(s)) for s in SCHEMAS[:2]]
    prompt = tokenizer.encode("Answer in JSON:")
    reqs = [
        request(
            prompt, 200, sampling=SamplingParams(temperature=1.0, seed=i), logits_processors=(p,)
        )
        for i, p in enumerate([exploding, broken, misfit, *sound])
    ]
    # on llguidance's pool, where a failure is not pinned to its row: found one by one
    engine = engine_with(model, tokenizer, grammar_masks=GrammarMasks(threads=2, pool_above_s=0))
    try:
        results = drive(engine, generate_all(engine, reqs))
    finally:
        engine.shutdown(timeout=10)
    exploded, stopped, refused, *good = results
    assert exploded.reason == "error" and "grammar exploded" in (exploded.finished.error or "")
    assert stopped.reason == "stop" and stopped.text == "" and broken.error
    assert refused.reason == "error", refused.text
    assert "Invalid buffer size" in (refused.finished.error or "")
    for r, schema in zip(good, SCHEMAS[:2], strict=True):
        assert r.reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), schema)


def test_tokens_are_read_from_arrays_scheduled_before_the_forward_pass(
    monkeypatch, tokenizer, compiler
):
    """A read of an array queued after the forward pass waits for all of the pass, so both
    paths schedule what they read (the context's tail; the batch's fed tokens) first, and
    the masks are computed while the device runs the pass."""
    from types import SimpleNamespace

    from mlx_server.engine.runners.batch_step import DecodeStep, RowGrammar

    vocab = len(tokenizer)
    scheduled: list[list[tuple[int, ...]]] = []
    real = mx.async_eval

    def spy(*arrays: mx.array) -> None:
        scheduled.append([tuple(a.shape) for a in arrays])
        real(*arrays)

    monkeypatch.setattr(mx, "async_eval", spy)
    per_row = compiler.processor(ConstraintSpec.json_object())
    per_row(mx.array([1, 2, 3]), mx.zeros((1, vocab)) + 1)
    assert scheduled == [[(1,)], [(1, vocab)]]

    scheduled.clear()
    grammar = compiler.processor(ConstraintSpec.json_object())
    batch = SimpleNamespace(uids=[7, 8], logits_processors=[(grammar,), ()])
    rows = {7: RowGrammar(grammar, BatchGrammar(grammar))}
    masks = GrammarMasks(threads=1)
    decode = DecodeStep(
        lambda x, cache=None: mx.zeros((2, 1, vocab)) + 1, batch, rows, lambda: masks
    )
    out = decode(mx.array([[3], [4]]), cache=None)
    assert scheduled == [[(2, 1)], [(2, vocab)]]
    assert batch.logits_processors == [(), ()]  # the grammar left the per-row list
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    assert out.shape == (2, 1, vocab) and out[0, 0, brace].item() == 1
    assert out[0, 0, 0].item() == float("-inf") and mx.all(out[1] == 1).item()
    masks.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_step_fills_every_row_in_one_call_and_consumes_on_its_own_thread(
    monkeypatch, tokenizer, compiler, threads
):
    """Each llguidance call that lets go of the interpreter lock must take it again, and
    another thread running Python (the event loop) may keep it up to the switch interval
    (5 ms): a step's masks are filled in one call (on llguidance's one thread, or its pool),
    never one call a row, and the tokens are consumed with calls that keep the lock."""
    import llguidance.numpy as llg_numpy

    calls: list[int] = []
    real_fill = llg_numpy.fill_next_token_bitmask_par

    def counted(executor: Any, pairs: list[Any], buf: np.ndarray) -> None:
        calls.append(len(pairs))
        real_fill(executor, pairs, buf)

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a call per row, or a consume that lets go of the lock")

    monkeypatch.setattr(llg_numpy, "fill_next_token_bitmask_par", counted)
    monkeypatch.setattr(llg_numpy, "consume_token_par", refused)
    monkeypatch.setattr(llguidance.LLMatcher, "unsafe_compute_mask_ptr", refused, raising=False)
    masks = GrammarMasks(threads=threads, pool_above_s=0.0)
    rows = [BatchGrammar(compiler.processor(ConstraintSpec.json_schema(s))) for s in SCHEMAS]
    vocab, rng, steps = len(tokenizer), random.Random(threads), 12
    tokens = [0] * len(rows)
    for _ in range(steps):
        out = masks.apply(rows, tokens, mx.zeros((len(rows), vocab)))
        tokens = [rng.choice(np.flatnonzero(np.array(r) > -np.inf).tolist()) for r in out]
    assert calls == [len(rows)] * steps
    assert all(not g.failed and g.processor.consumed == steps - 1 for g in rows)
    assert masks.pooled == (steps if threads > 1 else 0)
    masks.close()


def test_a_new_group_s_first_step_masks_its_grammars_at_once(
    monkeypatch, model, tokenizer, compiler
):
    """mlx-lm steps a group just out of prefill once in a batch of its own, with the raw
    model and the per-row processor lists; there too the group's grammars are masked in
    one call (``mask_first_steps``), never through each row's processor call, and the
    tokens are the per-row path's."""
    calls = {"per_row": 0}
    real_call = GrammarLogitsProcessor.__call__

    def counted(self: GrammarLogitsProcessor, tokens: mx.array, logits: mx.array) -> mx.array:
        calls["per_row"] += 1
        return real_call(self, tokens, logits)

    monkeypatch.setattr(GrammarLogitsProcessor, "__call__", counted)
    outputs = {}
    for batched in (False, True):
        masks = GrammarMasks(threads=1)
        engine = engine_with(model, tokenizer, batch_grammars=batched, grammar_masks=masks)
        calls["per_row"] = 0
        try:
            outputs[batched] = drive(
                engine, generate_all(engine, mixed_requests(tokenizer, compiler))
            )
        finally:
            engine.shutdown(timeout=10)
        if batched:
            assert calls["per_row"] == 0 and masks.steps > 10
        else:
            assert calls["per_row"] > 10 and masks.steps == 0
    for new, old in zip(outputs[True], outputs[False], strict=True):
        assert (new.text, new.reason) == (old.text, old.reason)
