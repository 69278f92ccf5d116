"""The verify passes' shapes in the warm-up (``speculative.warm``): which pieces the plan
holds, that each runs the pass it names, and that none run where the warm-up is off."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from engine_runner import request, solo, text_engine

from mlx_server.engine.core.engine import EngineConfig
from mlx_server.engine.core.tuning import WarmUp
from mlx_server.engine.core.warming import Warming
from mlx_server.engine.runners.assembly import text_runner
from mlx_server.engine.speculative import batch as spec_batch
from mlx_server.engine.speculative import warm
from mlx_server.engine.speculative.assembly import speculative_runner
from mlx_server.engine.speculative.runner import Speculation


@pytest.fixture(scope="module")
def lm(tiny_model_dir: Path) -> tuple[Any, Any]:
    from mlx_lm import load

    model, tokenizer = load(str(tiny_model_dir))[:2]
    return model, tokenizer


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Each verify pass run: (path, batch size, width)."""
    seen: list[tuple[str, int, int]] = []
    lone, batch = warm.verify, spec_batch.verify_batch

    def lone_verify(model: Any, cache: Any, last: int, draft: list[int], **kw: Any) -> Any:
        seen.append(("lone", 1, len(draft)))
        return lone(model, cache, last, draft, **kw)

    def batch_verify(b: Any, pending: list[int], drafts: list[list[int]], *a: Any, **kw: Any):
        seen.append(("batch", len(pending), kw["width"]))
        return batch(b, pending, drafts, *a, **kw)

    monkeypatch.setattr(warm, "verify", lone_verify)
    monkeypatch.setattr(spec_batch, "verify_batch", batch_verify)
    return seen


def _spec(k: int = 4) -> Speculation:
    return Speculation(num_draft_tokens=k, prompt_lookup=True)


def test_the_plan_holds_each_width_lone_before_serving_and_each_batch_size_later(lm, passes):
    model, tokenizer = lm
    runner = speculative_runner(model, tokenizer, EngineConfig(max_batch_size=3), _spec(4))
    shapes = runner.warm_shapes(3)
    assert len(shapes.first) == 3  # widths 1, 2, 4
    assert sorted(shapes.later) == [1, 2, 3] and all(len(p) == 3 for p in shapes.later.values())
    plan = WarmUp(model, 3, 64, float("inf"), shapes=shapes)
    plan.before_ready()
    assert passes == [("lone", 1, 1), ("lone", 1, 2), ("lone", 1, 4)]
    passes.clear()
    deadline = time.monotonic() + 120
    while plan.pending and time.monotonic() < deadline:
        plan.step()
    assert not plan.pending
    # the batch's lone size first, then each size's widths after its decode steps
    want = [("batch", b, w) for b in (1, 2, 3) for w in (1, 2, 4)]
    assert passes == want


def test_without_a_lone_runner_the_batch_of_one_warms_before_serving(lm, passes):
    model, tokenizer = lm
    cfg = EngineConfig(max_batch_size=2, solo=False)
    shapes = speculative_runner(model, tokenizer, cfg, _spec(2)).warm_shapes(2)
    assert sorted(shapes.later) == [2]
    for piece in shapes.first:
        for _ in piece():
            pass
    assert passes == [("batch", 1, 1), ("batch", 1, 2)]


def test_no_verify_pass_without_speculation_or_with_the_warm_up_off(lm, passes):
    model, tokenizer = lm
    assert not hasattr(text_runner(model, tokenizer, EngineConfig()), "warm_shapes")
    plain = Warming(model, EngineConfig(max_batch_size=2, warm_up=True), text_runner(
        model, tokenizer, EngineConfig(max_batch_size=2)))  # fmt: skip
    assert plain.before_serving(float("inf")) == ""
    # the CPU and Metal: start-up leaves the warm-up off (it builds nothing there)
    cfg = EngineConfig(max_batch_size=2)
    off = Warming(model, cfg, speculative_runner(model, tokenizer, cfg, _spec(2)))
    assert off.before_serving(30.0) == "" and not off.pending
    assert passes == []


def test_an_engine_serves_after_warming_its_verify_passes_while_idle(lm, passes):
    model, tokenizer = lm
    cfg = EngineConfig(max_batch_size=2, warm_up=True, warm_idle_s=0.0)
    engine = text_engine(model, tokenizer, cfg, speculation=_spec(2))
    engine.start()
    try:
        assert engine.wait_ready(60)
        deadline = time.monotonic() + 120
        while engine.warming_up and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine.warming_up
        assert {p for p in passes if p[0] == "batch"} == {
            ("batch", b, w) for b in (1, 2) for w in (1, 2)
        }

        done = solo(engine, [request(tokenizer.encode("Hello there"), 5, ignore_eos=True)])
        assert done[0].finished.usage.completion_tokens == 5
    finally:
        engine.shutdown()


class _Clock:
    """Seconds that pass only when a scripted piece says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _scripted(clock: _Clock, ran: list[str], name: str, costs: list[float]):
    """A warm-up piece whose generator steps cost ``costs`` seconds on ``clock``."""

    def piece():
        for i, cost in enumerate(costs):
            clock.now += cost
            ran.append(f"{name}{i}")
            yield

    return piece


def test_the_shapes_before_serving_stop_at_the_budget_and_the_rest_runs_first_while_idle(lm):
    """A budget of 10 s: A (3 + 3 s) runs whole, B's first step ends past the budget, so B's
    second step and C wait for idle time, where they run before anything else."""
    model, _ = lm
    clock, ran = _Clock(), []
    first = [
        _scripted(clock, ran, "A", [3, 3]),
        _scripted(clock, ran, "B", [5, 5]),
        _scripted(clock, ran, "C", [1]),
    ]
    later = {1: [_scripted(clock, ran, "L", [1])]}
    shapes = warm.ShapePieces(first=first, later=later, budget_s=100.0, what="x")
    plan = WarmUp(model, 1, 16, 10.0, shapes=shapes, clock=clock)
    assert plan.before_ready() == 11.0
    assert ran == ["A0", "A1", "B0"] and plan.deferred == 2 and plan.pending
    for _ in range(5):  # B's rest, then C, then the batch's own: a step each, one more to end
        plan.step()
    assert ran == ["A0", "A1", "B0", "B1", "C0", "L0"]
    plan.close()


def test_an_unbounded_budget_runs_every_shape_before_serving(lm):
    model, _ = lm
    clock, ran = _Clock(), []
    first = [_scripted(clock, ran, n, [50, 50]) for n in "AB"]
    shapes = warm.ShapePieces(first=first, budget_s=0.0, what="x")
    plan = WarmUp(model, 1, 16, float("inf"), shapes=shapes, clock=clock)
    plan.before_ready()
    assert ran == ["A0", "A1", "B0", "B1"] and plan.deferred == 0
    plan.close()


def test_the_start_line_says_which_shapes_were_left_for_idle_time(lm, monkeypatch):
    from functools import partial

    from mlx_server.engine.core import warming

    model, _ = lm
    clock, ran, lines = _Clock(), [], []
    first = [_scripted(clock, ran, n, [20]) for n in "ABC"]

    class Runner:
        def warm_shapes(self, max_batch_size: int) -> warm.ShapePieces:
            return warm.ShapePieces(first=list(first), budget_s=60.0, what="verify passes")

    monkeypatch.setattr(warming, "WarmUp", partial(WarmUp, clock=clock))
    monkeypatch.setattr(warming, "log", lines.append)
    w = Warming(model, EngineConfig(max_batch_size=3, warm_up=True), Runner())
    assert w.before_serving(30.0) == ""
    assert ran == ["A0", "B0"]  # B's step starts within the budget and ends past it
    (line,) = [x for x in lines if x.startswith("Warm-up:")]
    # B, under way (what follows its step), and C
    assert line.endswith("left for idle time: 2 of the 3 verify passes, batch sizes 2-3"), line
    assert w.pending
    w.later()  # B's end
    w.later()
    assert ran == ["A0", "B0", "C0"]
    w.close()
