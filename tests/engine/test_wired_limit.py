"""The wired limit is set once per process from what the loaded models claim, on a device
that reports a recommended working set (Metal; described here as MLX reports it)."""

from __future__ import annotations

import pytest

from mlx_server.engine.core import wired

pytestmark = pytest.mark.tiny

GiB = 1 << 30


@pytest.fixture
def metal(monkeypatch):
    """A 16 GB Mac's device: the limits set are recorded instead of applied."""
    applied: list[int] = []
    monkeypatch.setattr(wired, "_recommended", lambda: 10 * GiB)
    monkeypatch.setattr(wired, "_apply", applied.append)
    monkeypatch.setattr(wired, "_claimed", 0)
    return applied


def test_several_models_load_and_unload_in_any_order(metal) -> None:
    wired.claim(3 * GiB)  # model A
    wired.claim(4 * GiB)  # model B
    wired.release(3 * GiB)  # A unloaded while B runs: B's share stays wired
    assert metal == [3 * GiB, 7 * GiB, 4 * GiB]
    wired.claim(9 * GiB)  # capped at the recommended working set
    assert metal[-1] == 10 * GiB


def test_no_limit_is_set_off_metal(monkeypatch) -> None:
    applied: list[int] = []
    monkeypatch.setattr(wired, "_recommended", lambda: None)
    monkeypatch.setattr(wired, "_apply", applied.append)
    assert wired.claim(GiB) is None and wired.release(GiB) is None
    assert applied == []


def test_generators_leave_the_limit_alone(metal, monkeypatch, tmp_path_factory) -> None:
    """A runner's BatchGenerator closes (a runner starting over, an engine stopping) without
    restoring the limit it found: nothing but the claims sets it."""
    import importlib

    import mlx.core as mx
    from engine_runner import load_varied_model

    from mlx_server.engine.runners.batch import BatchRunner

    restored: list[int] = []
    # As on Metal: the generator replaces the limit (here: 0) with the working set.
    generate = importlib.import_module("mlx_lm.generate")  # the module, not the function
    monkeypatch.setattr(generate, "maybe_set_recommended_wired_limit", lambda: 0)
    monkeypatch.setattr(mx, "set_wired_limit", restored.append)
    model, _, _ = load_varied_model(tmp_path_factory)
    wired.claim(2 * GiB)
    runner = BatchRunner(model, [0], max_batch_size=2, prefill_step_size=64)
    assert runner._gen._old_wired_limit is None
    runner.close()
    assert restored == []  # close() restored nothing
    assert metal == [2 * GiB, 2 * GiB]  # the claim, then put back after the generator's


def test_an_engine_claims_while_it_runs(metal, tmp_path_factory) -> None:
    from engine_runner import load_varied_model, running_engine

    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    with running_engine(model, tokenizer, wired_bytes=2 * GiB) as engine:
        assert engine.wait_ready(60)
        assert metal == [2 * GiB]
    assert metal == [2 * GiB, 0]
