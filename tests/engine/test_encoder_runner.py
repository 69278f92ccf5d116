"""The encoder step: compiled, it gives what the uncompiled step gives, batched or alone,
across many batch shapes (and after its traces are dropped); a model that cannot be traced
runs uncompiled."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_server.engine.embedding import runner as encoder_runner
from mlx_server.engine.embedding.runner import EncoderRunner
from mlx_server.models.embedding import EncoderSpec

pytestmark = pytest.mark.tiny

TINY_BERT = {
    "model_type": "bert",
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "hidden_size": 16,
    "intermediate_size": 32,
    "max_position_embeddings": 64,
    "vocab_size": 50,
}
SPEC = EncoderSpec("embedding", "mean", True, 64, 16)


@pytest.fixture(scope="module")
def bert():
    from mlx_embeddings.utils import _get_classes

    model_class, args_class, _, _ = _get_classes(TINY_BERT)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(TINY_BERT))
    model.eval()
    return model


def seqs(rng: np.random.Generator, n: int) -> list[list[int]]:
    return [list(rng.integers(1, 50, size=int(rng.integers(2, 30)))) for _ in range(n)]


def test_compiled_equals_eager_batched_or_alone(bert):
    batch = seqs(np.random.default_rng(0), 12)
    compiled = EncoderRunner(bert, SPEC).run(batch)
    eager = EncoderRunner(bert, SPEC, compile=False).run(batch)
    assert compiled.shape == (12, 16)
    assert np.allclose(compiled, eager, atol=1e-5)
    alone = np.concatenate([EncoderRunner(bert, SPEC).run([s]) for s in batch])
    assert np.allclose(alone, eager, atol=1e-5)
    assert np.allclose(np.linalg.norm(compiled, axis=-1), 1.0, atol=1e-5)


def test_traces_are_dropped_after_many_shapes(bert, monkeypatch):
    monkeypatch.setattr(encoder_runner, "MAX_TRACES", 3)
    runner = EncoderRunner(bert, SPEC)
    eager = EncoderRunner(bert, SPEC, compile=False)
    rng = np.random.default_rng(1)
    first = runner._compiled
    for n in range(1, 8):  # seven batch shapes
        batch = seqs(rng, n)
        assert np.allclose(runner.run(batch), eager.run(batch), atol=1e-5)
        assert len(runner._shapes) <= 3
    assert runner._compiled is not first and runner._compiled is not None


class Branching:
    """A model that reads an array's value while it runs, as mlx-embeddings' Qwen3 does."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, attention_mask):
        out = self.model(input_ids, attention_mask=attention_mask)
        if attention_mask[:, -1].sum() == attention_mask.shape[0]:  # evaluates an array
            return out
        return out


def test_a_model_that_cannot_be_traced_runs_uncompiled(bert):
    batch = seqs(np.random.default_rng(2), 4)
    runner = EncoderRunner(Branching(bert), SPEC)
    got = runner.run(batch)
    assert runner._compiled is None
    assert np.allclose(got, EncoderRunner(bert, SPEC, compile=False).run(batch), atol=1e-5)
