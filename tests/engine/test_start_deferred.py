"""What the start leaves for after the readiness line: the warm-up's batch sizes above one
(run while the engine is idle, a request served meanwhile) and the grammar compiler's
wrapping of the tokenizer (in the engine's idle time, ``Engine.when_idle``, or by the first
compile)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from clients import wait_until
from engine_runner import text_engine

from mlx_server.engine.core.engine import Engine, EngineConfig
from mlx_server.engine.core.tuning import WarmUp
from mlx_server.engine.grammar.constraints import (
    ConstraintCompiler,
    ConstraintError,
    ConstraintSpec,
)
from mlx_server.events import Finished
from mlx_server.types import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def lm(tiny_model_dir: Path) -> tuple[Any, Any]:
    from mlx_lm import load

    model, tokenizer = load(str(tiny_model_dir))[:2]
    return model, tokenizer


async def _generate(engine: Engine, prompt: list[int]) -> Finished:
    req = GenerationRequest(
        request_id="r",
        prompt_tokens=prompt,
        max_tokens=5,
        sampling=SamplingParams(temperature=0.0),
        ignore_eos=True,
    )
    async for event in engine.submit(req):
        if isinstance(event, Finished):
            return event
    raise AssertionError("no Finished event")


def test_batch_sizes_above_one_warm_up_while_idle_and_a_request_runs_meanwhile(lm):
    model, tokenizer = lm
    engine = text_engine(model, tokenizer, EngineConfig(max_batch_size=4, warm_up=True))
    engine.start()
    try:
        assert engine.wait_ready(60)
        assert engine.warming_up  # sizes 2-4 and the full chunk are left for idle time
        done = asyncio.run(_generate(engine, tokenizer.encode("Hello there")))
        assert done.reason == "length" and done.usage.completion_tokens == 5
        deadline = time.monotonic() + 60
        while engine.warming_up and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine.warming_up
        again = asyncio.run(_generate(engine, tokenizer.encode("Hello again")))
        assert again.usage.completion_tokens == 5
    finally:
        engine.shutdown()


def test_a_request_during_the_idle_warm_up_is_admitted_before_the_next_piece(lm, monkeypatch):
    model, tokenizer = lm
    events: list[str] = []
    plans: list[WarmUp] = []
    started, release = threading.Event(), threading.Event()
    real_step = WarmUp.step

    def step(plan: WarmUp) -> float:
        first = not plans
        plans.append(plan)
        events.append("piece")
        if first:  # the first idle piece is under way when the request comes
            started.set()
            assert release.wait(30)
        return real_step(plan)

    monkeypatch.setattr(WarmUp, "step", step)
    config = EngineConfig(max_batch_size=3, warm_up=True, warm_idle_s=0.0)
    engine = text_engine(model, tokenizer, config)
    real_start = engine._start
    monkeypatch.setattr(engine, "_start", lambda seq: (events.append("admit"), real_start(seq)))
    engine.start()
    try:
        assert engine.wait_ready(60) and started.wait(60)
        done: list[Finished] = []
        prompt = tokenizer.encode("Hello there")
        client = threading.Thread(
            target=lambda: done.append(asyncio.run(_generate(engine, prompt)))
        )
        client.start()
        deadline = time.monotonic() + 30
        while not engine._sched.pending and time.monotonic() < deadline:
            time.sleep(0.005)
        assert engine._sched.pending  # queued behind the piece under way
        release.set()
        client.join(60)
        assert done and done[0].usage.completion_tokens == 5
        assert events[:2] == ["piece", "admit"]  # served before the warm-up's next piece
        deadline = time.monotonic() + 60
        while engine.warming_up and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine.warming_up
        plan = plans[0]
        assert all(p is plan for p in plans)
        assert not plan._later and plan._run is None and plan.spent < plan.budget_s
        # batch sizes 2 and 3 and the full chunk, each split into its generator steps
        assert events.count("piece") > 3
    finally:
        release.set()
        engine.shutdown()


def test_idle_time_counts_from_readiness_so_a_first_request_meets_no_piece(lm, monkeypatch):
    """A client's first request, sent on the readiness line, runs before any idle piece: on
    a fresh CUDA machine a piece can take seconds (a probe waited 45 s behind them)."""
    model, tokenizer = lm
    events: list[str] = []
    real_step = WarmUp.step
    monkeypatch.setattr(WarmUp, "step", lambda plan: (events.append("piece"), real_step(plan))[1])
    engine = text_engine(
        model, tokenizer, EngineConfig(max_batch_size=3, warm_up=True, warm_idle_s=30.0)
    )
    real_start = engine._start
    monkeypatch.setattr(engine, "_start", lambda seq: (events.append("admit"), real_start(seq)))
    engine.start()
    try:
        assert engine.wait_ready(60)
        done = asyncio.run(_generate(engine, tokenizer.encode("Hello there")))
        assert done.usage.completion_tokens == 5
        assert events == ["admit"] and engine.warming_up  # the pieces wait for idle time
    finally:
        engine.shutdown()


def test_a_lazy_compiler_compiles_as_one_that_wrapped_the_tokenizer_at_once(tiny_tokenizer):
    spec = ConstraintSpec.json_object()
    now = ConstraintCompiler(tiny_tokenizer)
    lazy = ConstraintCompiler(tiny_tokenizer, lazy=True)
    assert lazy._wrapped is None  # nothing wrapped before the first compile
    a, b = now.processor(spec), lazy.processor(spec)
    assert a.mask_words == b.mask_words
    assert a.matcher.compute_bitmask() == b.matcher.compute_bitmask()


def test_a_lazy_compiler_prepared_ahead_wraps_once_and_caches_nothing(tiny_tokenizer, monkeypatch):
    """``prepare`` (the engine's idle time) does what a first constrained request would
    wait for; the request then wraps nothing and finds the cache as it was."""
    from mlx_server.engine.grammar import constraints

    wraps: list[object] = []
    real = constraints.llguidance.hf.from_tokenizer
    monkeypatch.setattr(
        constraints.llguidance.hf,
        "from_tokenizer",
        lambda *a, **k: (wraps.append(a), real(*a, **k))[1],
    )
    lazy = ConstraintCompiler(tiny_tokenizer, lazy=True)
    assert wraps == []
    lazy.prepare()
    assert len(wraps) == 1 and lazy.hits == lazy.misses == 0
    spec = ConstraintSpec.json_object()
    got = lazy.processor(spec)
    want = ConstraintCompiler(tiny_tokenizer).processor(spec)
    assert len(wraps) == 2  # the second: the eager compiler's own
    assert lazy.misses == 1 and got.matcher.compute_bitmask() == want.matcher.compute_bitmask()


def test_idle_work_runs_on_the_engine_thread_after_readiness_and_a_failure_only_logs(
    lm, monkeypatch
):
    from mlx_server.engine.core import warming

    model, tokenizer = lm
    lines: list[str] = []
    monkeypatch.setattr(warming, "log", lines.append)
    ran: list[str] = []

    def fails() -> None:
        raise RuntimeError("no vocabulary")

    engine = text_engine(model, tokenizer, EngineConfig(max_batch_size=2, warm_idle_s=0.0))
    engine.when_idle("a failing piece", fails)
    engine.when_idle("a piece", lambda: ran.append(threading.current_thread().name))
    assert engine.warming_up  # left for idle time (no warm-up plan on this host)
    engine.start()
    try:
        assert engine.wait_ready(60)
        assert wait_until(lambda: not engine.warming_up, "the idle-time work", timeout=60)
        assert ran == ["mlx-engine"]
        failed = [x for x in lines if x.startswith("Idle-time preparation of a failing piece")]
        assert failed == [
            "Idle-time preparation of a failing piece failed: RuntimeError: no vocabulary"
        ]
        assert any(x.startswith("Idle time: a piece ready in ") for x in lines), lines
        done = asyncio.run(_generate(engine, tokenizer.encode("Hello there")))
        assert done.reason == "length" and done.usage.completion_tokens == 5
    finally:
        engine.shutdown()


def test_a_slow_tokenizer_is_refused_at_once_even_by_a_lazy_compiler():
    class Slow:
        eos_token_id = 0

    with pytest.raises(ConstraintError, match="fast tokenizer"):
        ConstraintCompiler(Slow(), lazy=True)


def test_requests_asking_for_one_schema_together_build_it_once(tiny_tokenizer, monkeypatch):
    import threading

    compiler = ConstraintCompiler(tiny_tokenizer)
    real, builds, release = compiler._build, [], threading.Event()

    def build(spec: ConstraintSpec) -> Any:
        builds.append(spec)
        assert release.wait(30)
        return real(spec)

    monkeypatch.setattr(compiler, "_build", build)
    spec = ConstraintSpec.json_schema({"type": "object", "properties": {"a": {"type": "string"}}})
    got: list[Any] = []
    threads = [
        threading.Thread(target=lambda: got.append(compiler.compile(spec))) for _ in range(6)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while compiler.hits + compiler.misses < 6 and time.monotonic() < deadline:
        time.sleep(0.01)  # every thread has asked: one builds, five wait for it
    release.set()
    for t in threads:
        t.join(30)
    assert len(builds) == 1 and compiler.misses == 1 and compiler.hits == 5
    assert len(got) == 6 and all(m is got[0] for m in got)
