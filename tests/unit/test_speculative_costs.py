"""The step-cost model and the plan over scripted timings (no model): kernel builds left
out of the costs, and the probing steps' share of the time bounded by what they cost
(with nothing ever accepted, speculation costs at most ``PROBE_SHARE`` over plain)."""

from __future__ import annotations

import pytest

from mlx_server.engine.speculative import plan_log as why
from mlx_server.engine.speculative.controller import (
    PROBE_SHARE,
    Acceptance,
    BatchPlan,
    DraftLength,
    spacing,
)
from mlx_server.engine.speculative.costs import StepCosts, bucket
from mlx_server.engine.speculative.plan_log import PlanLog


def test_a_build_far_above_the_estimate_is_left_out_and_two_in_a_row_count() -> None:
    c = StepCosts(8)
    for _ in range(3):
        c.record_plain(8, 0.010)
    c.record_verify(8, 1, 0.9)  # the shape's first pass: dropped
    c.record_verify(8, 1, 0.012)
    c.record_verify(8, 1, 0.85)  # a build (a prefill's shapes came in between): left out
    assert c.table()[8][1] == pytest.approx(1.2) and c.builds == 1
    c.record_verify(8, 1, 0.013)
    assert c.table()[8][1] == pytest.approx(1.25)  # the median of those kept, as usual again
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


def test_early_dear_passes_do_not_outlast_the_steady_cost() -> None:
    """The demo model's code edit on the H100 (trace, ms): the plain step 3.94, the first
    passes of width 1 and 8 about 22, then width 8 at 8-9 with a 27 now and then. The
    estimate follows the steady cost within a few passes (an average from 21 said 12 after
    a dozen, and the plan stopped drafting), and width 1, tried only early, never costs more
    than width 8."""
    c = StepCosts(8)
    for _ in range(3):
        c.record_plain(1, 0.00394)
    for ms in (23.27, 22.26):
        c.record_verify(1, 1, ms / 1e3)
    passes = (23.38, 21.00, 8.98, 8.63, 8.45, 8.35, 27.37, 9.09, 8.86, 9.08, 8.34)
    for i, ms in enumerate(passes):
        c.record_verify(1, 8, ms / 1e3)
        if i == 5:  # four steady passes after the dear ones
            assert c.verify[(1, 8)] == pytest.approx(0.00863)
    assert c.verify[(1, 8)] == pytest.approx(0.00908)  # 27.37 among the last five
    assert c.cost(1, 8) == pytest.approx(0.00908)
    assert c.verify[(1, 1)] == pytest.approx(0.02226)  # its one sample kept...
    assert c.cost(1, 1) == pytest.approx(0.00908)  # ...but no dearer than the wider pass


# Verify cost over the plain step, by width: at one row and at eight as measured on a GPU
# (8B 4-bit), and a pass that always costs as much as a kernel build.
TABLES = {
    "one row": {1: 1.3, 2: 1.5, 4: 1.8, 8: 2.1},
    "eight rows": {1: 5.8, 2: 4.8, 4: 9.0, 8: 13.7},
    "dear": {1: 85.0, 2: 85.0, 4: 85.0, 8: 85.0},
}
T0 = 0.010
# The first steps measure: each width's first pass is dropped, so the widest is measured at
# the second explore (at most 2 x 256 steps in).
STEPS, SETTLED = 2000, 600


def _share(extra: list[float]) -> float:
    """What the verifying steps add to plain decoding's time, after the first steps."""
    return sum(extra[SETTLED:]) / (STEPS - SETTLED)


@pytest.mark.parametrize("table", TABLES.values(), ids=TABLES.keys())
def test_a_lone_sequence_probing_with_nothing_accepted_adds_at_most_the_share(table) -> None:
    plan = DraftLength(8)  # a draft model's: it backs off and probes
    extra: list[float] = []
    for _ in range(STEPS):
        k = plan.next_k()
        if k:
            w = bucket(k, 8)
            plan.record(k, 0, T0 * table[w], w)
            extra.append(table[w] - 1)
        else:
            plan.record_plain(T0)
            extra.append(0.0)
    assert sum(1 for e in extra if e) >= 3  # it does probe
    assert _share(extra) <= PROBE_SHARE


@pytest.mark.parametrize("table", TABLES.values(), ids=TABLES.keys())
def test_a_batch_trying_and_exploring_with_nothing_accepted_adds_at_most_the_share(table):
    plan, rows = BatchPlan(8), [Acceptance() for _ in range(8)]  # draft models' rows
    extra: list[float] = []
    for _ in range(STEPS):  # as BatchSpeculator.next drives the plan
        extra.append(0.0)
        if not plan.worth_trying(rows):
            for r in rows:
                r.tick()
            plan.record_plain(8, T0)
            continue
        tried = [r.ready for r in rows]
        k = plan.choose(rows, [8 if t else 0 for t in tried])
        if k == 0:
            for r in (r for r, t in zip(rows, tried, strict=True) if t):
                r.record(0, 0)
            plan.record_try(0, 0)
            continue
        w = bucket(k, 8)
        plan.record_draft(8, w, T0 * table[w])
        extra[-1] = table[w] - 1
        for r, t in zip(rows, tried, strict=True):
            if t:
                r.record(k, 0)
            else:
                r.tick()
        plan.record_try(k * sum(tried), 0)
    assert sum(1 for e in extra if e) >= 3
    assert _share(extra) <= PROBE_SHARE


def test_probes_are_spaced_by_what_a_pass_costs() -> None:
    c = StepCosts(8)
    c.record_plain(1, T0)
    c.record_plain(1, T0)
    assert spacing(c, 1, 1) == 5  # the guess: 1.15 plain steps
    c.record_verify(1, 1, 0.5)
    c.record_verify(1, 1, 0.061)  # 6.1 plain steps: once in 170 steps adds 3 %
    assert spacing(c, 1, 1) == 170
    assert spacing(StepCosts(8), 1, 1) == 0  # nothing measured: the plan measures first


def test_the_log_says_why_a_batch_stopped_drafting_and_what_was_left_out() -> None:
    log = PlanLog()
    plan, rows = BatchPlan(8, log=log), [Acceptance() for _ in range(4)]
    plan.record_plain(4, T0)
    plan.record_plain(4, T0)
    assert plan.worth_trying(rows)  # a draft model's prior: expected to pay at the guess
    for _ in range(3):  # the first pass, a build, then the pass's cost
        plan.record_draft(4, 8, [0.5, 3.0, 0.03][_])
    for r in rows:
        r.record(8, 0)
        r.record(8, 0)  # two failures: every row backs off
    plan.record_try(32, 0)
    assert not plan.worth_trying(rows)
    text = log.summary()
    assert "drafting stopped 1 time(s)" in text and "batch 4" in text
    assert "w=8: 3.00" in text and "left out as kernel builds: 1" in text


def test_a_lone_sequence_whose_pass_was_measured_too_dear_measures_it_again() -> None:
    log = PlanLog()
    plan = DraftLength(8, shadowed=True, log=log)  # a lookup: its rate is current
    dear, cheap = 0.200, 0.015  # a pass measured on a busy machine, then what it costs
    drafted = steps = 0
    while steps < 2000:
        steps += 1
        k = plan.next_k()
        if k:
            w = bucket(k, 8)
            plan.record(k, k, dear if drafted < 2 else cheap, w)
            drafted += 1
        else:
            plan.record_plain(T0)
            plan.acceptance.observe(8, 8)  # the shadow drafts match
        if drafted > 2 and log.steps[why.DRAFTS] > 100:
            break
    assert log.steps[why.EXPLORE] >= 1  # it measured again...
    assert log.steps[why.DRAFTS] > 100  # ...and drafts since
    assert steps < 1000  # the first explore waits out the spacing of a 20-step pass: 634


def test_a_batch_of_lookups_whose_pass_was_measured_too_dear_measures_it_again() -> None:
    """Shadowed rows only (prompt lookup): their rates decide, and a pass measured too dear
    (its first samples on a busy machine, or still building) is measured again now and
    then, as a lone sequence's is; drafting then goes on at the pass's true cost."""
    log = PlanLog()
    plan = BatchPlan(8, log=log)
    rows = [Acceptance(0.9, backs_off=False) for _ in range(4)]
    dear, cheap = 0.200, 0.015
    drafted = steps = 0
    while steps < 3000:
        steps += 1
        if plan.worth_trying(rows) and plan.choose(rows, [8] * 4):
            plan.record_draft(4, 8, dear if drafted < 2 else cheap)
            plan.record_try(32, 32)
            drafted += 1
        else:
            plan.record_plain(4, T0)
        if drafted > 2 and log.steps[why.DRAFTS] > 100:
            break
    assert log.steps[why.EXPLORE] >= 1  # it measured again...
    assert log.steps[why.DRAFTS] > 100  # ...and drafts since
    assert steps < 1000  # the first explore waits out the spacing of a 20-step pass: 634
