"""A batched vision model's warm-up: on CUDA every shape a request meets first costs it
seconds (a fresh H200 answered a text-only request to a Qwen2.5-VL 7B in 33.7 s, its text
twin, warmed, in 0.09 s), so the language model's shapes (batch sizes, prefill buckets)
are warmed as a text model's are. The warm-up runs on the model the batch runs, mlx-vlm's
language model behind mlx-lm's call (Qwen-VL's multimodal positions included); a model
whose requests run one at a time has none."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from engine_runner import request, solo
from test_vision_batch import gemma  # noqa: F401 (the fixture)
from tiny_vlm import build_tiny_idefics3, build_tiny_vlm

from mlx_server.engine.core.config import EngineConfig
from mlx_server.engine.core.engine import Engine
from mlx_server.engine.core.tuning import WarmUp
from mlx_server.engine.runners.vision import VisionRunner, vision_runner
from mlx_server.engine.runners.vision_batch import VisionBatchRunner
from mlx_server.models.loader import load_model

WARM = EngineConfig(max_batch_size=3, prefill_step_size=64, warm_up=True, prefill_buckets=True)


def warm_all(model: Any) -> None:
    """The whole warm-up, before and after the readiness line; it must run every piece."""
    plan = WarmUp(model, 3, 64, float("inf"), buckets=True)
    secs = plan.before_ready()
    pieces = 0
    while plan.pending:  # batch sizes 2 and 3, then a full chunk in the batch
        secs += plan.step()
        pieces += 1
        assert pieces < 100, "the warm-up did not end"
    assert plan.pieces == pieces > 0 and secs > 0


@pytest.mark.parametrize(
    "build", [build_tiny_vlm, build_tiny_idefics3], ids=["qwen2_vl", "idefics3"]
)
def test_the_language_model_of_a_batched_vlm_warms_every_shape(build: Any, tmp_path: Path):
    loaded = load_model(str(build(tmp_path / "vlm")))
    setup = vision_runner(loaded.model, loaded.tokenizer, WARM)
    assert isinstance(setup.runner, VisionBatchRunner)
    assert setup.config.warm_up and setup.config.prefill_buckets
    warm_all(setup.model)


def test_the_sliding_window_language_model_of_gemma3_warms_too(gemma):  # noqa: F811
    """Gemma 3's rotating caches: the warm-up runs (the lone path keeps them unpadded)."""
    model, tok, _, _ = gemma
    setup = vision_runner(model, tok, WARM)
    assert isinstance(setup.runner, VisionBatchRunner) and setup.config.warm_up
    warm_all(setup.model)


def test_a_vlm_that_runs_one_request_at_a_time_has_no_warm_up(tmp_path: Path):
    loaded = load_model(str(build_tiny_vlm(tmp_path / "vlm")))
    # What batch_refusal answers for a family not checked to batch.
    loaded.model.config.model_type = "not-batched"
    setup = vision_runner(loaded.model, loaded.tokenizer, replace(WARM))
    assert isinstance(setup.runner, VisionRunner) and setup.serial_reason
    assert not setup.config.warm_up and not setup.config.prefill_buckets


class _Spy:
    """The VLM's language model, recording the length of every input it is given."""

    def __init__(self, lm: Any):
        self.lm = lm
        self.lengths: list[int] = []

    def __call__(self, inputs: mx.array, *args: Any, **kwargs: Any) -> Any:
        self.lengths.append(int(inputs.shape[1]))
        return self.lm(inputs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lm, name)


def test_bucketed_prefill_on_a_qwen_vl_language_model_gives_the_same_output(tmp_path: Path):
    """Qwen-VL's positions follow its cache's offset: the padding trimmed from the cache
    leaves the next chunk's positions where they were, so a bucketed prefill answers what
    the plain one does, a warm turn too (text-only requests on the lone runner)."""
    loaded = load_model(str(build_tiny_vlm(tmp_path / "vlm")))
    tok = loaded.tokenizer
    history = list(tok.encode("the cat sat on the mat and looked at the door " * 3))
    turns = [history, history + list(tok.encode(" then it slept for a while"))]
    results, spies = [], []
    for buckets in (True, False):
        cfg = EngineConfig(kv_bytes_per_token=256, prefill_step_size=64, prefill_buckets=buckets)
        setup = vision_runner(loaded.model, tok, cfg)
        spy = _Spy(setup.model.lm)  # the language model behind the batch and the lone runner
        setup.model.lm = spy
        engine = Engine(setup.model, tok, setup.config, runner=setup.runner)
        engine.start()
        try:
            reqs = [request(t, 10, ignore_eos=True, logprobs=True) for t in turns]
            results.append(solo(engine, reqs))
        finally:
            engine.shutdown(timeout=10)
        spies.append(spy)
    padded, plain = results
    for a, b in zip(padded, plain, strict=True):
        assert a.finished.usage.completion_tokens == b.finished.usage.completion_tokens == 10
        assert [e.token for e in a.logprobs] == [e.token for e in b.logprobs]
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    assert padded[1].cached > 0  # the warm turn was served from the prefix cache
    chunks = [n for n in spies[0].lengths if n > 1]
    assert chunks and set(chunks) <= {16, 32, 64}, spies[0].lengths
    assert {n for n in spies[1].lengths if n > 1} - {16, 32, 64}  # unpadded: other lengths
