"""The vision families people run, as tiny random-weight models (``tiny_vlm_families``), in
the continuous batch: each request with an image gives, batched with another image request
and a text-only one, what mlx-vlm's own ``generate_step`` gives it alone (the one-at-a-time
runner) on the same weights; Gemma 4 also after a cached system prompt, and with an image's
tokens seeing each other (26B, 31B, and Gemma 4 unified: prefilled in one piece, as mlx-vlm
does); and a prompt with two images, text between them, as one with one. Two families run
one at a time (``vision_prefill.REFUSED_FAMILIES``): LLaVA-NeXT, whose image features
outnumber its image tokens (a prompt whose embeddings are longer than its tokens fails alone
if it ever reaches the batch), and Gemma 3n, whose prompt embeddings mlx-vlm scales unlike
the tokens its language model is fed (checked here, so that the day mlx-vlm changes it
shows)."""

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
from mlx_server.engine.runners.vision_prefill import VisionPrefill

BATCHED = [
    "llava",
    "pixtral",
    "mistral3",
    "qwen2_5_vl",
    "qwen3_vl",
    "gemma4",
    "gemma4_bidirectional",
    "gemma4_unified",
]
# Those whose image tokens see each other: mlx-vlm prefills their prompts with images in one
# piece (Gemma 4 26B-A4B and 31B, Gemma 4 unified).
BIDIRECTIONAL = ["gemma4_bidirectional", "gemma4_unified"]


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


@pytest.mark.parametrize("family", BATCHED)  # every batched family takes two in mlx-vlm
def test_two_images_in_one_prompt_batched_as_mlx_vlm_gives_alone(family, tmp_path):
    """A prompt with two pictures, text between them, their pixels as the family's processor
    gives two images (a batch of images with a row of ``image_sizes`` each for Pixtral and
    Mistral 3, Qwen-VL's patches one after the other with a row of ``image_grid_thw`` each,
    a batch of images for LLaVA and Gemma 4, whose tokens see only their own image's where
    they see each other), batched beside a one-image request and a text-only one, gives
    what mlx-vlm gives it alone; so does the same two pictures swapped, which gives another
    answer. Sent again, its prompt comes from the prefix cache, with the same answer; with
    another second picture, the prompt up to that picture comes from the cache (families
    whose caches can be cut back there) and the answer is mlx-vlm's, another one (the
    second picture counts)."""
    tiny = build(family, tmp_path)
    both, swapped, same, one = tiny.req2(0, 1), tiny.req2(1, 0), tiny.req2(0, 0), tiny.req(0)
    alone = mlx_vlm_alone(tiny, [both, swapped, one, same])
    engine = vision_engine(tiny.model, tiny.tokenizer, _config())
    engine.start()
    try:
        # (long enough to decode beside the three prompts' prefills, a chunk at a time)
        text = request(tiny.text_prompt, 24, ignore_eos=True)
        together = batched(engine, [tiny.req2(0, 1), tiny.req2(1, 0), tiny.req(0), text])
        assert engine.stats()["peak_batch"] == 4
        assert engine.stats()["vision_prefills"] == 3
        again = drive(engine, generate(engine, tiny.req2(0, 1)))
        other_second = drive(engine, generate(engine, tiny.req2(0, 0)))
    finally:
        engine.shutdown(timeout=10)
    assert [r.reason for r in together] == ["length"] * 4
    for ours, theirs in zip(together[:3], alone[:3], strict=True):
        assert logprobs(ours) == pytest.approx(logprobs(theirs), abs=1e-3)
    assert logprobs(alone[0]) != pytest.approx(logprobs(alone[1]), abs=1e-3)  # order matters
    assert logprobs(alone[0]) != pytest.approx(logprobs(alone[2]), abs=1e-3)
    assert again.cached == len(both.prompt_tokens) - 1
    assert logprobs(again) == pytest.approx(logprobs(alone[0]), abs=1e-3)
    # The same first picture and text, another second one: the keys part at its tokens.
    keys = zip(both.cache_tokens, same.cache_tokens, strict=True)
    second = next(k for k, (a, b) in enumerate(keys) if a != b)
    if family.startswith("gemma4"):  # sliding-window layers: not cut back into a prompt
        assert other_second.cached <= second
    else:
        assert other_second.cached == second
    assert logprobs(other_second) == pytest.approx(logprobs(alone[3]), abs=1e-3)
    assert logprobs(alone[3]) != pytest.approx(logprobs(alone[0]), abs=1e-3)  # it counts


@pytest.mark.parametrize("family", ["gemma4", *BIDIRECTIONAL])
def test_an_image_after_a_cached_system_prompt_as_mlx_vlm_gives_alone(
    family, tmp_path, monkeypatch
):
    """A text request leaves the system prompt's state in the prefix cache; a request with an
    image after that system prompt then gives what mlx-vlm gives it alone. Gemma 4 goes on
    from the cached state (the image's per-layer inputs, a chunk's share each); where an
    image's tokens see each other (26B, 31B), mlx-vlm prefills a prompt with images in one
    piece, and so does the batch: from the prompt's start, the cached prefix set aside (the
    mask lets the image's tokens see each other only in a piece that starts at 0)."""
    tiny = build(family, tmp_path)
    (alone,) = mlx_vlm_alone(tiny, [tiny.req(0, with_system=True)])
    engine = vision_engine(tiny.model, tiny.tokenizer, _config())
    starts: list[int] = []  # where the vision prefill starts feeding the prompt
    init = VisionPrefill.__init__

    def noting(self: VisionPrefill, *args: Any, **kw: Any) -> None:
        init(self, *args, **kw)
        starts.append(len(self.fed))

    monkeypatch.setattr(VisionPrefill, "__init__", noting)
    engine.start()
    try:
        system = request(tiny.system + tiny.text_prompt, 3, system_prefix_tokens=len(tiny.system))
        drive(engine, generate(engine, system))
        ours = drive(engine, generate(engine, tiny.req(0, with_system=True)))
    finally:
        engine.shutdown(timeout=10)
    assert ours.cached == len(tiny.system) > 8  # past the sliding window of 8 tokens
    assert starts == [0 if family in BIDIRECTIONAL else len(tiny.system)]
    assert logprobs(ours) == pytest.approx(logprobs(alone), abs=1e-3)


@pytest.mark.parametrize("family", ["llava_next", "gemma3n"])
def test_a_refused_family_runs_one_at_a_time_as_mlx_vlm(family, tmp_path):
    tiny = build(family, tmp_path)
    reason = vision_runner(tiny.model, tiny.tokenizer, _config()).serial_reason
    assert reason.startswith(f"{family} models are not batched: ")
    engine = vision_engine(tiny.model, tiny.tokenizer, _config())
    engine.start()
    try:
        ours = drive(engine, generate(engine, tiny.req(0)))
    finally:
        engine.shutdown(timeout=10)
    (theirs,) = mlx_vlm_alone(tiny, [tiny.req(0)])
    assert ours.reason == "length" and logprobs(ours) == logprobs(theirs)


def test_gemma3n_prompts_are_embedded_unlike_the_tokens_its_language_model_is_fed(tmp_path):
    """Why Gemma 3n is not batched: mlx-vlm's ``get_input_embeddings`` embeds a prompt's text
    tokens without the sqrt(hidden_size) scale its language model gives tokens fed as ids,
    as decode steps are and as the batch feeds a prompt's last token (Hugging Face's
    Gemma 3n scales both). Should mlx-vlm make them agree, this fails: batch it then."""
    import mlx.core as mx

    tiny = build("gemma3n", tmp_path)
    lm = tiny.model.language_model
    ids = mx.array([tiny.text_prompt])
    prompt = tiny.model.get_input_embeddings(ids, None).inputs_embeds
    as_ids = lm(ids).logits
    assert not mx.allclose(lm(ids, inputs_embeds=prompt).logits, as_ids, atol=1e-3).item()
    scaled = prompt * lm.model.hidden_size**0.5
    assert mx.allclose(lm(ids, inputs_embeds=scaled).logits, as_ids, atol=1e-4).item()


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
