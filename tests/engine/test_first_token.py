"""Before the readiness line the engine computes one token: a model that cannot run is
refused at start with the reason, instead of a readiness line and an error on every request.
Where kernels are built on first use, a first token still running ``ready_after_s`` into it
(a cold kernel cache) no longer holds the line: requests wait for it, and if it then fails
every request is refused with the reason."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from engine_runner import collect, drive, load_varied_model, request, running_engine

from mlx_server.errors import ModelUnavailable

pytestmark = pytest.mark.tiny


class _Broken:
    """A model whose forward pass fails, as one with a layer this build cannot run does."""

    def __init__(self, model: Any):
        self._model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("Quantized SDPA does not support attention sinks")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_a_model_that_cannot_compute_a_token_is_a_start_error(tmp_path_factory) -> None:
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    with running_engine(_Broken(model), tokenizer, first_token=True) as engine:
        assert engine.wait_ready(60)
        assert "could not compute a token" in engine.start_error
        assert "attention sinks" in engine.start_error


def test_a_model_that_runs_starts_clean(tmp_path_factory) -> None:
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    with running_engine(model, tokenizer, first_token=True) as engine:
        assert engine.wait_ready(60)
        assert engine.start_error == ""


def test_the_engine_learns_its_logits_dtype_from_the_first_token(tmp_path_factory):
    """What a sampler's check runs in: the model's own logits (bfloat16 here), not float32."""
    import mlx.core as mx

    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())  # here: a lazy graph belongs to this thread's stream
    with running_engine(model, tokenizer, first_token=True) as engine:
        assert engine.wait_ready(60)
        assert engine._warming.logits_dtype == mx.bfloat16


class _Held:
    """A model whose first forward pass waits for ``release`` (a first token building
    kernels on a cold kernel cache), then runs, or with ``fail`` raises."""

    def __init__(self, model: Any, fail: bool = False):
        self._model = model
        self._fail = fail
        self.release = threading.Event()
        self.first_done = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.first_done:
            assert self.release.wait(60), "the test never released the first token"
            self.first_done = True
            if self._fail:
                raise RuntimeError("nvrtc: error: failed to compile the kernel")
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_a_slow_first_token_does_not_hold_the_readiness(tmp_path_factory) -> None:
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    held = _Held(model)
    with running_engine(held, tokenizer, first_token=True, ready_after_s=0.2) as engine:
        try:
            assert engine.wait_ready(60)
            assert not held.first_done  # ready while the first token is still running
            assert engine.start_error == ""

            async def run() -> Any:
                handle = engine.submit(request([5, 6, 7], max_tokens=4, ignore_eos=True))
                held.release.set()
                return await collect(handle)

            result = drive(engine, run())
        finally:
            held.release.set()
        assert held.first_done
        assert result.reason == "length" and result.finished.usage.completion_tokens == 4


def test_a_first_token_that_fails_after_readiness_refuses_every_request(
    tmp_path_factory,
) -> None:
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    held = _Held(model, fail=True)
    with running_engine(held, tokenizer, first_token=True, ready_after_s=0.2) as engine:
        try:
            assert engine.wait_ready(60)
            assert engine.start_error == ""

            async def run() -> Any:
                waiting = engine.submit(request([5, 6, 7], max_tokens=4))
                held.release.set()
                return await collect(waiting)

            queued = drive(engine, run())
        finally:
            held.release.set()
        # the request that waited for the first token ends with the reason
        assert queued.reason == "error"
        assert "failed to compile the kernel" in (queued.finished.error or "")
        assert "failed to compile the kernel" in engine.start_error
        # and every later one is refused before it is queued

        async def later() -> None:
            engine.submit(request([5, 6, 7], max_tokens=4))

        with pytest.raises(ModelUnavailable, match="cannot serve.*failed to compile"):
            drive(engine, later())
        assert engine.queue_depth == 0 and engine.active_count == 0


def test_a_first_token_within_the_time_still_comes_before_readiness(tmp_path_factory) -> None:
    """The readiness waits for a first token that finishes in time, and its failure is
    still a start error (no readiness for a model that cannot run)."""
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    with running_engine(_Broken(model), tokenizer, first_token=True, ready_after_s=30) as engine:
        assert engine.wait_ready(60)
        assert "attention sinks" in engine.start_error


def test_once_ready_early_the_rest_of_the_warm_up_waits_for_idle_time(
    tmp_path_factory, monkeypatch
) -> None:
    """Requests may be waiting once the engine said it was ready: nothing more runs before
    them (the start line says what is left), as on a cold kernel cache."""
    from mlx_server.engine.core import warming
    from mlx_server.engine.core.config import EngineConfig
    from mlx_server.engine.core.warming import Warming

    lines: list[str] = []
    monkeypatch.setattr(warming, "log", lines.append)
    model, _, _ = load_varied_model(tmp_path_factory)
    held = _Held(model)
    cfg = EngineConfig(
        max_batch_size=2, prefill_step_size=64, warm_up=True, first_token=True, ready_after_s=0.1
    )
    w = Warming(held, cfg)
    try:
        assert w.before_serving(30.0, ready=held.release.set) == ""
    finally:
        held.release.set()
    assert w.ready_early and w.pending
    assert any("still being computed after 0.1s" in x for x in lines), lines
    (line,) = [x for x in lines if x.startswith("Warm-up: the first token in")]
    assert "left for idle time: all" in line
    w.close()
