"""Before the readiness line the engine computes one token: a model that cannot run is
refused at start with the reason, instead of a readiness line and an error on every request."""

from __future__ import annotations

from typing import Any

import pytest
from engine_runner import load_varied_model, running_engine

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
