"""An engine step that takes long is logged with its parts and what ran (a kernel build on a
fresh CUDA machine, a busy device): the line that tells a slow first answer apart from a
wait in the queue."""

from __future__ import annotations

from typing import Any

import pytest
from clients import wait_until
from engine_runner import drive, generate, load_varied_model, request, running_engine

from mlx_server.engine.core import slow_steps
from mlx_server.engine.core.slow_steps import PARTS, StepClock

pytestmark = pytest.mark.tiny


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    got: list[str] = []
    monkeypatch.setattr(slow_steps, "log", got.append)
    return got


def test_every_step_past_the_threshold_is_logged_with_its_parts(tmp_path_factory, lines):
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    prompt = list(range(5, 45))
    with running_engine(model, tokenizer, slow_step_s=0.0) as engine:
        assert engine.wait_ready(60)
        result = drive(engine, generate(engine, request(prompt, 4, ignore_eos=True)))
    assert result.reason == "length"
    steps = [x for x in lines if x.startswith("Slow engine step: ")]
    first = [x for x in steps if "1 running, 1 prefilling (40 prompt tokens left)" in x]
    assert first, steps  # the step that started the request still had its prompt to prefill
    decoding = [x for x in steps if "1 running, 0 prefilling (0 prompt tokens left)" in x]
    assert decoding, steps
    for part in PARTS:
        assert f"{part} " in first[0], first[0]


def test_a_fast_step_is_not_logged(tmp_path_factory, lines):
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    with running_engine(model, tokenizer, slow_step_s=600.0) as engine:
        assert engine.wait_ready(60)
        drive(engine, generate(engine, request(list(range(5, 25)), 3, ignore_eos=True)))
    assert not [x for x in lines if x.startswith("Slow engine step")]


class _Seq:
    def __init__(self, left: Any):
        self.prefill_left = left


def test_the_line_adds_up_the_parts_and_counts_the_prompts_left(lines, monkeypatch):
    now = iter([0.0, 0.5, 3.5, 3.75, 4.0])
    monkeypatch.setattr(slow_steps.time, "perf_counter", lambda: next(now))
    clock = StepClock(2.0)
    clock.start()
    clock.mark(PARTS[0])
    clock.running([_Seq(30), _Seq(0), _Seq(None), _Seq(2)])
    for part in PARTS[1:]:
        clock.mark(part)
    line = clock.report()
    assert line == (
        "Slow engine step: 4.0s (starting requests 0.50s, the runner's step 3.00s, "
        "the prefix cache 0.25s, answers 0.25s); 4 running, 2 prefilling (32 prompt tokens left)"
    )
    assert lines == [line]


def test_where_the_line_is_off_the_step_reads_nothing(lines):
    class Unread:
        @property
        def prefill_left(self) -> int:
            raise AssertionError("read a sequence where the line is off")

    clock = StepClock(float("inf"))
    clock.start()
    clock.running([Unread()])
    clock.mark(PARTS[1])
    assert clock.report() is None and lines == []


def test_a_slow_idle_warm_up_piece_is_logged_with_what_it_ran(tmp_path_factory, lines, monkeypatch):
    """A request that arrives during an idle-time piece waits for it (on a fresh CUDA
    machine a piece builds kernels for seconds): the line names the piece."""
    from mlx_server.engine.core import warming

    got: list[str] = []
    monkeypatch.setattr(warming, "log", got.append)
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    with running_engine(
        model, tokenizer, slow_step_s=0.0, warm_up=True, warm_idle_s=0.0, max_batch_size=2
    ) as engine:
        assert engine.wait_ready(60)
        assert wait_until(lambda: not engine.warming_up, "the idle-time warm-up", timeout=120)
    pieces = [x for x in got if x.startswith("Slow warm-up piece: ")]
    assert pieces, got
    assert any("(drain: a batch of 2)" in x for x in pieces), pieces
    assert all(x.endswith("a request that came meanwhile waited for it") for x in pieces)


def test_piece_names():
    from functools import partial

    from mlx_server.engine.core.tuning import _lone_decode, _prefill_bucket, piece_name

    assert piece_name(partial(_prefill_bucket, object(), 768, 0)) == "prefill_bucket 768 0"
    assert piece_name(partial(_lone_decode, object(), 4096)) == "lone_decode 4096"
