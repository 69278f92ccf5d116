"""The prefill buckets of the warm-up hold to its budget before the readiness line: on a
fresh CUDA machine each bucket builds kernels (seconds each; 155 s for a Qwen3.5-like 9B in
all), so the buckets past the budget wait for idle time, where they run first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlx_server.engine.core import tuning, warming
from mlx_server.engine.core.config import EngineConfig
from mlx_server.engine.core.tuning import WarmUp
from mlx_server.engine.core.warming import Warming


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Any:
    from mlx_lm import load

    return load(str(tiny_model_dir))[0]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.cost = 10.0  # seconds a bucket piece takes

    def __call__(self) -> float:
        return self.now


# The budget's logic is checked on three short buckets; the table itself has one (64, see
# ``test_every_short_chunk_meets_one_length``).
THREE_SHORT = (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048)


@pytest.fixture
def buckets(monkeypatch: pytest.MonkeyPatch) -> tuple[_Clock, list[tuple[int, int]]]:
    """Each bucket piece costs 10 s on the clock and records its length and its prefix."""
    clock, ran = _Clock(), []
    monkeypatch.setattr(tuning, "PREFILL_BUCKETS", THREE_SHORT)

    def piece(model: Any, n: int, prefix: int = 64):
        clock.now += clock.cost
        ran.append((n, prefix))
        yield from ()  # as the real piece: its one step is its whole work

    monkeypatch.setattr(tuning, "_prefill_bucket", piece)
    return clock, ran


def test_buckets_past_the_budget_run_first_while_idle(model, buckets):
    clock, ran = buckets
    plan = WarmUp(model, 3, 256, 30.0, buckets=True, clock=clock)
    plan.before_ready()
    assert ran == [(16, 64), (32, 64), (64, 64)]  # the fourth would start with the budget spent
    assert plan.deferred_buckets == 2 and plan.pending
    plan.step()
    plan.step()
    assert ran[3:] == [(128, 0), (256, 0)]  # a first prompt's chunks, from an empty cache
    assert plan.pending  # batch sizes 2 and 3 come next
    plan.close()


def test_a_bucket_started_within_the_budget_runs_whole_and_the_rest_waits(model, buckets):
    clock, ran = buckets
    plan = WarmUp(model, 1, 256, 25.0, buckets=True, clock=clock)
    plan.before_ready()
    assert [n for n, _ in ran] == [16, 32, 64]  # 64 starts within the budget and ends past it
    assert plan.deferred_buckets == 2
    while plan.pending:
        plan.step()
    assert ran == [(16, 64), (32, 64), (64, 64), (128, 0), (256, 0)]


def test_idle_time_has_a_budget_of_its_own(model, buckets):
    clock, ran = buckets
    clock.cost = 15.0
    plan = WarmUp(model, 1, 512, 20.0, buckets=True, clock=clock)
    plan.before_ready()
    assert [n for n, _ in ran] == [16, 32]  # 30 s: the second started within the 20
    while plan.pending:
        plan.step()
    # twice the readiness line's budget (40 s): a piece starts while less than 40 s went
    # to idle time's pieces (0, 15, 30 s), so the third runs whole and the 512 never
    assert ran[2:] == [(64, 64), (128, 0), (256, 0)]


def test_a_piece_that_builds_kernels_leaves_the_rest_for_idle_time(model, buckets):
    """A first token read from a kernel cache that lacks the pieces' kernels (an upgrade's
    new pieces, a cache another program filled): the first piece seen building (a step of
    ``building_s`` or more) ends what the readiness line waits for, well within its budget.
    On a fresh H100 the whole budget's pieces held the line 27 s after a 1 s first token."""
    clock, ran = buckets
    clock.cost = 4.0
    samplers = _sampler_pieces(clock, ran, 3, 0.5)
    plan = WarmUp(model, 1, 256, 30.0, buckets=True, samplers=samplers, building_s=3.0, clock=clock)
    plan.before_ready()
    assert ran == [(16, 64)]  # 4 s: building; 32 and 64 would have fit in the 30 s
    assert plan.building and plan.deferred_buckets == 4 and plan.deferred_samplers == 3
    while plan.pending:
        plan.step()
    # idle time runs what was left, the short buckets and the samplers first
    assert ran[1:] == [(32, 64), (64, 64), (-1, 0), (-2, 0), (-3, 0), (128, 0), (256, 0)]

    # pieces quicker than ``building_s`` (kernels read from the cache) fill the budget
    clock.now, ran[:] = 0.0, []
    clock.cost = 2.0
    plan = WarmUp(model, 1, 256, 30.0, buckets=True, samplers=samplers, building_s=3.0, clock=clock)
    plan.before_ready()
    assert ran == [(16, 64), (32, 64), (64, 64), (-1, 0), (-2, 0), (-3, 0)]
    assert not plan.building and plan.deferred_buckets == 2
    plan.close()


def test_the_start_line_says_kernels_are_being_built(model, buckets, monkeypatch):
    clock, _ = buckets
    clock.cost = 5.0
    monkeypatch.setattr(warming, "builds_kernels_on_first_use", lambda: True)
    line = _start_line(model, clock, monkeypatch, solo=True, budget=30.0)
    assert "kernels being built" in line and "left for idle time" in line, line


def _start_line(
    model: Any, clock: _Clock, monkeypatch: pytest.MonkeyPatch, solo: bool, budget: float = 20.0
) -> str:
    """The warm-up's start line for three batch sizes and a ``budget``."""
    from functools import partial

    lines: list[str] = []
    monkeypatch.setattr(warming, "WarmUp", partial(WarmUp, clock=clock))
    monkeypatch.setattr(warming, "log", lines.append)
    cfg = EngineConfig(
        max_batch_size=3, warm_up=True, prefill_buckets=True, prefill_step_size=256, solo=solo
    )
    w = Warming(model, cfg)
    assert w.before_serving(budget) == ""
    w.close()
    (line,) = [x for x in lines if x.startswith("Warm-up:")]
    return line


def test_the_start_line_counts_the_buckets_left(model, buckets, monkeypatch):
    clock, ran = buckets
    # the batch path: its size 1 first, uncounted by the fake clock
    line = _start_line(model, clock, monkeypatch, solo=False)
    assert [n for n, _ in ran] == [16, 32]
    assert line.endswith("left for idle time: 3 of the prefill buckets, batch sizes 2-3"), line
    assert "batch sizes 1," in line


def test_the_short_chunks_are_the_ones_attention_computes_plainly_on_cuda():
    from mlx_server.models.cuda_attention import SHORT_QUERY

    assert tuning.SHORT_CHUNK == SHORT_QUERY


def test_a_bucket_piece_prefills_from_an_empty_cache_or_after_a_prefix(model, monkeypatch):
    import mlx.core as mx

    seen: list[tuple[int, int]] = []
    fused = mx.fast.scaled_dot_product_attention

    def spy(q: mx.array, k: mx.array, v: mx.array, **kw: Any) -> mx.array:
        seen.append((q.shape[2], k.shape[2]))
        return fused(q, k, v, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    for _ in tuning._prefill_bucket(model, 128, 0):
        pass
    assert set(seen) == {(128, 128)}
    seen.clear()
    for _ in tuning._prefill_bucket(model, 128):
        pass
    assert set(seen) == {(64, 64), (128, 192)}


def test_the_long_buckets_wait_for_idle_time_whatever_the_budget(model, buckets):
    clock, ran = buckets
    plan = WarmUp(model, 1, 256, 1000.0, buckets=True, clock=clock)
    plan.before_ready()
    assert ran == [(16, 64), (32, 64), (64, 64)]  # a next turn's short chunks
    assert plan.deferred_buckets == 2 and plan.deferred == 0
    while plan.pending:
        plan.step()
    assert ran[3:] == [(128, 0), (256, 0)]  # from an empty cache only


def test_a_lone_path_engine_warms_its_short_buckets_before_the_batch_s_size_one(model, buckets):
    """A first request runs alone on the lone path: its buckets come first; the batch's size
    1 (mlx-lm's batch cache, other kernels) runs after them within the budget, else first
    in idle time."""
    clock, ran = buckets
    drained: list[int] = []
    real = WarmUp._drain

    def drain(self, prompts, max_tokens):
        drained.append(len(prompts))
        clock.now += clock.cost
        yield from real(self, prompts, max_tokens)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(WarmUp, "_drain", drain)
        plan = WarmUp(model, 2, 256, 30.0, buckets=True, solo=True, clock=clock)
        plan.before_ready()
        assert ran == [(16, 64), (32, 64), (64, 64)] and drained == []  # the budget is spent
        assert plan.batch1_deferred and plan.deferred_buckets == 2
        plan.step()
        assert drained == [1]  # first in idle time
        while plan.pending:
            plan.step()
        # then batch size 2, and one prompt longer than a prefill step
        assert ran[3:] == [(128, 0), (256, 0)] and drained == [1, 2, 1]

        clock.now, ran[:], drained[:] = 0.0, [], []
        plan = WarmUp(model, 2, 256, 1000.0, buckets=True, solo=True, clock=clock)
        plan.before_ready()
        assert ran == [(16, 64), (32, 64), (64, 64)] and drained == [1]  # then size 1
        assert not plan.batch1_deferred
        plan.close()


def test_the_start_line_says_when_batch_size_one_waits_for_idle_time(model, buckets, monkeypatch):
    clock, _ = buckets
    line = _start_line(model, clock, monkeypatch, solo=True)
    assert line.startswith("Warm-up: the prefill buckets in "), line
    assert line.endswith("left for idle time: 3 of the prefill buckets, batch sizes 1-3"), line


def _sampler_pieces(clock: _Clock, ran: list[tuple[int, int]], n: int, cost: float) -> list[Any]:
    """``n`` sampler pieces of ``cost`` seconds each, recorded in ``ran`` as (-i, 0)."""

    def piece(i: int):
        clock.now += cost
        ran.append((-i, 0))
        yield from ()

    return [lambda i=i: piece(i) for i in range(1, n + 1)]


def test_the_samplers_run_after_the_short_buckets_and_wait_at_idle_time_s_front(model, buckets):
    """The samplers' kernels (seconds each on a fresh CUDA machine) come after what a first
    request's prefill meets, within the budget; those left run first in idle time, after
    the short buckets left and before the long ones."""
    clock, ran = buckets
    plan = WarmUp(
        model, 1, 256, 45.0, buckets=True, samplers=_sampler_pieces(clock, ran, 3, 5.0), clock=clock
    )
    plan.before_ready()
    # 16, 32, 64 (30 s), then samplers 1 and 2 (40 s), the third starts at 40 s, ends at 45
    assert ran == [(16, 64), (32, 64), (64, 64), (-1, 0), (-2, 0), (-3, 0)]
    assert plan.deferred_samplers == 0 and plan.samplers == 3
    plan.close()

    clock.now, ran[:] = 0.0, []
    plan = WarmUp(
        model, 1, 256, 25.0, buckets=True, samplers=_sampler_pieces(clock, ran, 3, 5.0), clock=clock
    )
    plan.before_ready()
    assert ran == [(16, 64), (32, 64), (64, 64)]  # the buckets spent the budget
    assert plan.deferred_samplers == 3 and plan.deferred_buckets == 2
    for _ in range(5):
        plan.step()
    assert ran[3:] == [(-1, 0), (-2, 0), (-3, 0), (128, 0), (256, 0)]
    plan.close()


def test_the_start_line_says_the_samplers_left_for_idle_time(model, buckets, monkeypatch):
    """With the logits' width known, the warm-up builds each of ``WARM_SETTINGS``' samplers;
    those past the budget are named on the start line."""
    from functools import partial

    clock, ran = buckets
    settings: list[Any] = []

    def sampler(params, ban, vocab, dtype):
        settings.append((params, ban, vocab))
        clock.now += 6.0
        yield from ()

    lines: list[str] = []
    monkeypatch.setattr(warming, "warm_sampler", sampler)
    monkeypatch.setattr(warming, "WarmUp", partial(WarmUp, clock=clock))
    monkeypatch.setattr(warming, "log", lines.append)
    cfg = EngineConfig(max_batch_size=1, warm_up=True, prefill_buckets=True, prefill_step_size=256)
    w = Warming(model, cfg, vocab=300)
    assert w.before_serving(40.0) == ""
    (line,) = [x for x in lines if x.startswith("Warm-up:")]
    # 30 s of buckets, then two samplers (6 s each) start within the 40
    n = len(warming.WARM_SETTINGS)
    assert [s for s, _, _ in settings] == [s for s, _ in warming.WARM_SETTINGS[:2]]
    assert line.endswith(
        f"left for idle time: 2 of the prefill buckets, {n - 2} of the {n} samplers"
    )
    assert ", the samplers in " in line and all(v == 300 for _, _, v in settings)
    w.close()


def test_every_warm_setting_s_sampler_runs_on_the_model_s_logits_dtype():
    import mlx.core as mx

    from mlx_server.engine.sampling.samplers import WARM_SETTINGS, warm_sampler

    for params, ban in WARM_SETTINGS:
        for dtype in (mx.float32, mx.bfloat16):
            assert list(warm_sampler(params, ban, 50, dtype)) == []


def test_every_short_chunk_meets_one_length():
    """MLX's CUDA backend builds a 4-bit matmul's kernel per tile of rows (8-16, 17-32, 33
    or more; half a minute each for an 8B model on a fresh H100): every chunk of up to 64
    tokens is padded to 64, so a first prompt of any short length meets the kernel the
    warm-up builds (a 31-token prompt waited 26.8 s for the 17-32 one)."""
    assert {tuning.bucket(n, 2048) for n in range(1, 65)} == {64}
    assert tuning.bucket(65, 2048) == 128 and tuning.bucket(40, 48) == 48
    assert tuning.bucket(3000, 2048) == 3000  # never below the chunk


def test_the_warm_up_s_short_bucket_is_the_one_length(model, monkeypatch):
    ran: list[tuple[int, int]] = []

    def piece(model: Any, n: int, prefix: int = 64):
        ran.append((n, prefix))
        yield from ()

    monkeypatch.setattr(tuning, "_prefill_bucket", piece)
    plan = WarmUp(model, 1, 256, 1000.0, buckets=True, solo=True)
    plan.before_ready()
    assert ran == [(64, 64)]  # its prefix: a first prompt's 64 from an empty cache
    plan.close()


def _cold_plan(
    model: Any, clock: _Clock, ran: list[tuple[int, int]], solo: bool, mp: pytest.MonkeyPatch
) -> WarmUp:
    """A cold plan for batch sizes 1-2 with two samplers; drains recorded as (0, prompts)."""

    def drain(self, prompts, max_tokens):
        ran.append((0, len(prompts)))
        yield from ()

    mp.setattr(WarmUp, "_drain", drain)
    samplers = _sampler_pieces(clock, ran, 2, 5.0)
    return WarmUp(
        model, 2, 256, 100.0, buckets=True, solo=solo, samplers=samplers, cold=True, clock=clock
    )


@pytest.mark.parametrize("solo", [True, False])
def test_cold_nothing_runs_before_readiness_and_a_first_request_s_pieces_come_first(
    model, buckets, solo, monkeypatch
):
    """Kernels being built now (an empty kernel cache): the readiness line waits for the
    first token only; idle time starts with what a first request meets: on the lone path
    its prompt's bucket and the likeliest samplers, then the batch's size 1; on the batch
    path its size 1 first."""
    clock, ran = buckets
    plan = _cold_plan(model, clock, ran, solo, monkeypatch)
    try:
        assert plan.before_ready() == 0.0 and ran == []
        assert plan.pending and plan.batch1_deferred
        assert plan.deferred_buckets == 5 and plan.deferred_samplers == 2
        assert plan.budget_s == 300.0  # idle time's own twice 100 s, and the readiness line's
        while plan.pending:
            plan.step()
        first = [(16, 64), (32, 64), (64, 64), (-1, 0), (-2, 0)]
        if solo:
            assert ran[:6] == [*first, (0, 1)]
        else:
            assert ran[:6] == [(0, 1), *first]
        assert ran[6:] == [(128, 0), (256, 0), (0, 2), (0, 1)]  # then size 2, a full chunk
    finally:
        plan.close()


def test_the_start_says_when_kernels_are_being_built_and_waits_for_the_first_token_only(
    model, buckets, monkeypatch
):
    """Where kernels are built on first use, a first token slower than
    ``COLD_FIRST_TOKEN_S`` means an empty kernel cache: the start line says so and leaves
    every piece for idle time; a fast one warms up as before."""
    from functools import partial

    clock, ran = buckets
    lines: list[str] = []
    monkeypatch.setattr(warming, "WarmUp", partial(WarmUp, clock=clock))
    monkeypatch.setattr(warming, "log", lines.append)
    monkeypatch.setattr(warming, "builds_kernels_on_first_use", lambda: True)
    cfg = EngineConfig(
        max_batch_size=2, warm_up=True, prefill_buckets=True, prefill_step_size=256, solo=True
    )
    for threshold, cold in ((0.0, True), (1e9, False)):
        monkeypatch.setattr(warming, "COLD_FIRST_TOKEN_S", threshold)
        lines.clear()
        ran.clear()
        w = Warming(model, cfg)
        assert w.before_serving(1000.0) == ""
        (line,) = [x for x in lines if x.startswith("Warm-up:")]
        if cold:
            assert line.startswith("Warm-up: the first token in "), line
            assert (
                "kernels built on first use" in line and "what a first request meets first" in line
            )
            assert ran == [] and w.pending
        else:
            assert ran == [(16, 64), (32, 64), (64, 64)], line
        w.close()
    # ranks in lockstep run every piece before serving, whatever the first token took
    monkeypatch.setattr(warming, "COLD_FIRST_TOKEN_S", 0.0)
    ran.clear()
    w = Warming(model, cfg)
    assert w.before_serving(float("inf")) == ""
    assert (128, 0) in ran and not w.pending


def test_a_cold_engine_says_it_is_ready_serves_and_warms_up_while_idle(
    tmp_path_factory, monkeypatch
):
    """A real engine on the lone path with the cold rule on (as on a fresh CUDA machine):
    ready after the first token, its first request answered as a plain engine answers it,
    and the pieces run in idle time afterwards."""
    import time

    from engine_runner import load_varied_model, request, running_engine, solo

    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    lines: list[str] = []
    monkeypatch.setattr(warming, "log", lines.append)
    monkeypatch.setattr(warming, "builds_kernels_on_first_use", lambda: True)
    monkeypatch.setattr(warming, "COLD_FIRST_TOKEN_S", 0.0)
    tokens = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3)
    cfg = {"max_batch_size": 2, "prefill_step_size": 256, "solo": True}
    with running_engine(
        model, tokenizer, warm_up=True, prefill_buckets=True, warm_idle_s=0.05, **cfg
    ) as cold:
        (got,) = solo(cold, [request(tokens, 12, ignore_eos=True)])
        deadline = time.monotonic() + 60
        while not any(x.startswith("Warm-up: done while idle") for x in lines):
            assert time.monotonic() < deadline, lines
            time.sleep(0.05)
    with running_engine(model, tokenizer, **cfg) as plain:
        (want,) = solo(plain, [request(tokens, 12, ignore_eos=True)])
    assert got.text == want.text and got.finished.usage.completion_tokens == 12
    first = next(x for x in lines if x.startswith("Warm-up:"))
    assert first.startswith("Warm-up: the first token in "), lines


def test_the_compiled_grammar_mask_is_warmed_where_it_runs(model, monkeypatch):
    """Where the grammar masks run as one compiled graph (a GPU), its kernels are built in
    the warm-up with the samplers', in the logits' dtype; where they do not, no piece."""
    import mlx.core as mx

    from mlx_server.engine.grammar import mask_bits

    cfg = EngineConfig(max_batch_size=1, warm_up=True)
    for fused, pieces in (
        (True, len(warming.WARM_SETTINGS) + 1),
        (False, len(warming.WARM_SETTINGS)),
    ):
        monkeypatch.setattr(mask_bits, "FUSED", fused)
        w = Warming(model, cfg, vocab=300)
        w.logits_dtype = mx.bfloat16
        got = w._samplers()
        assert len(got) == pieces
        if fused:
            assert got[-1].func is mask_bits.warm_mask and got[-1].args == (300, mx.bfloat16)
            assert list(got[-1]()) == []  # it runs: the graph built on this device
