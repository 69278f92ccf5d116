"""The step-cost model and the plan over scripted timings (no model): kernel builds left
out of the costs, and the probing steps' share bounded by what they cost."""

from __future__ import annotations

import pytest

from mlx_server.engine.speculative.costs import StepCosts


def test_a_build_far_above_the_estimate_is_left_out_and_two_in_a_row_count() -> None:
    c = StepCosts(8)
    for _ in range(3):
        c.record_plain(8, 0.010)
    c.record_verify(8, 1, 0.9)  # the shape's first pass: dropped
    c.record_verify(8, 1, 0.012)
    c.record_verify(8, 1, 0.85)  # a build (a prefill's shapes came in between): left out
    assert c.table()[8][1] == pytest.approx(1.2) and c.builds == 1
    c.record_verify(8, 1, 0.013)
    assert c.table()[8][1] == pytest.approx(1.22)  # averaged as usual again
    c.record_verify(8, 1, 0.08)  # dear twice in a row: the cost has changed
    c.record_verify(8, 1, 0.08)
    assert c.table()[8][1] == pytest.approx(8.0)
    assert c.builds == 2


def test_a_build_before_any_estimate_is_bounded_by_plain_steps_per_position() -> None:
    c = StepCosts(8)
    c.record_plain(1, 0.010)
    c.record_plain(1, 0.010)
    c.record_verify(1, 8, 0.020)  # first: dropped
    c.record_verify(1, 8, 60.0)  # 60 s: a build, far above 4 x 9 plain steps
    assert 8 not in c.table().get(1, {})
    c.record_verify(1, 8, 0.021)
    assert c.table() == {1: {8: pytest.approx(2.1)}}


def test_a_plain_step_that_built_kernels_is_replaced_by_the_next() -> None:
    c = StepCosts(8)
    c.record_plain(4, 30.0)  # the size's first step built its kernels
    c.record_plain(4, 0.010)
    assert c.measured(4) and c.t0[4] == pytest.approx(0.010)
    c.record_plain(4, 0.5)  # left out
    c.record_plain(4, 0.010)
    assert c.t0[4] == pytest.approx(0.010)
    c.record_verify(4, 2, 1.0)  # first: dropped
    c.record_verify(4, 2, 0.9)  # left out
    c.record_verify(4, 2, 0.8)  # two builds in a row count...
    assert c.verify[(4, 2)] == pytest.approx(0.8)
    c.record_verify(4, 2, 0.015)  # ...until a sample far below replaces them
    assert c.verify[(4, 2)] == pytest.approx(0.015)
