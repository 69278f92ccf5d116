"""The vision families people run, as tiny random-weight models (``tiny_vlm_families``), in
the continuous batch: each request with an image gives, batched with another image request
and a text-only one, what mlx-vlm's own ``generate_step`` gives it alone (the one-at-a-time
runner) on the same weights. LLaVA-NeXT's image features outnumber its image tokens
(anyres): it runs one at a time, and a prompt whose embeddings are longer than its tokens
fails alone if it ever reaches the batch."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from engine_runner import drive, generate, request, vision_engine
from test_vision_engine import batched
from tiny_vlm_families import build

from mlx_server.engine.core.engine import Engine, EngineConfig
from mlx_server.engine.runners.vision import VisionRunner, vision_runner
from mlx_server.engine.runners.vision_batch import VisionBatchRunner

BATCHED = ["llava", "pixtral", "mistral3", "qwen2_5_vl", "qwen3_vl"]


def _config(**kw: Any) -> EngineConfig:
    return EngineConfig(kv_bytes_per_token=256, prefill_step_size=8, **kw)


def mlx_vlm_alone(tiny: Any, reqs: list[Any]) -> list[Any]:
    """Each request through mlx-vlm's ``generate_step``, one at a time."""
    eos = sorted(tiny.tokenizer.eos_token_ids)
    serial = Engine(
        tiny.model,
        tiny.tokenizer,
        _config(prompt_cache_size=0, max_batch_size=1, solo=False),
        runner=VisionRunner(tiny.model, eos, prefill_step_size=8),
    )
    serial.start()
    try:
        return [asyncio.run(generate(serial, r)) for r in reqs]
    finally:
        serial.shutdown(timeout=10)


def logprobs(result: Any) -> list[float]:
    return [e.logprob for e in result.logprobs]


@pytest.mark.parametrize("family", BATCHED)
def test_batched_as_mlx_vlm_gives_alone(family, tmp_path):
    tiny = build(family, tmp_path)
    alone = mlx_vlm_alone(tiny, [tiny.req(0), tiny.req(1)])
    assert vision_runner(tiny.model, tiny.tokenizer, _config()).serial_reason == ""
    engine = vision_engine(tiny.model, tiny.tokenizer, _config())
    engine.start()
    try:
        text = request(tiny.text_prompt, 5, ignore_eos=True)
        together = batched(engine, [tiny.req(0), tiny.req(1), text])
        assert engine.stats()["peak_batch"] == 3
        assert engine.stats()["vision_prefills"] == 2
        # The same picture again: its prompt from the prefix cache, the same answer.
        again = drive(engine, generate(engine, tiny.req(0)))
    finally:
        engine.shutdown(timeout=10)
    assert [r.reason for r in together] == ["length"] * 3
    for ours, theirs in zip(together[:2], alone, strict=True):
        assert logprobs(ours) == pytest.approx(logprobs(theirs), abs=1e-3)
    assert logprobs(alone[0]) != pytest.approx(logprobs(alone[1]), abs=1e-3)  # pixels matter
    assert again.cached == len(tiny.req(0).prompt_tokens) - 1
    assert logprobs(again) == pytest.approx(logprobs(alone[0]), abs=1e-3)


def test_llava_next_runs_one_at_a_time_as_mlx_vlm(tmp_path):
    tiny = build("llava_next", tmp_path)
    assert "llava_next" in vision_runner(tiny.model, tiny.tokenizer, _config()).serial_reason
    engine = vision_engine(tiny.model, tiny.tokenizer, _config())
    engine.start()
    try:
        ours = drive(engine, generate(engine, tiny.req(0)))
    finally:
        engine.shutdown(timeout=10)
    (theirs,) = mlx_vlm_alone(tiny, [tiny.req(0)])
    assert ours.reason == "length" and logprobs(ours) == logprobs(theirs)


def test_embeddings_longer_than_the_prompt_fail_their_request_only(tmp_path):
    """LLaVA-NeXT's features are longer than its prompt's image tokens: forced into the
    batch, that request fails with a clear error and the text request beside it runs on."""
    tiny = build("llava_next", tmp_path)
    eos = sorted(tiny.tokenizer.eos_token_ids)
    runner = VisionBatchRunner(tiny.model, eos, max_batch_size=4, prefill_step_size=8)
    engine = Engine(runner.lm, tiny.tokenizer, _config(), runner=runner)
    engine.start()
    try:
        text = request(tiny.text_prompt, 5, ignore_eos=True)
        failed, ok = batched(engine, [tiny.req(0), text])
    finally:
        engine.shutdown(timeout=10)
    assert failed.reason == "error"
    assert "image features" in (failed.finished.error or "")
    assert ok.reason == "length" and ok.finished.usage.completion_tokens == 5
