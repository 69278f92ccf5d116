"""The vision runner under the Engine, from Python, on the tiny Qwen2-VL: pixels reach the model, requests with
and without images share the batch, cancellation, limits, errors and shutdown."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from dataclasses import replace
from typing import Any

import pytest
from engine_runner import collect, drive, generate, request, vision_engine
from PIL import Image
from tiny_vlm import build_tiny_vlm

from mlx_server.engine.core.engine import Engine, EngineConfig
from mlx_server.engine.runners.vision import VisionRunner
from mlx_server.errors import Overloaded
from mlx_server.models.loader import load_model
from mlx_server.models.media import MediaLimits
from mlx_server.models.prompt import render_prompt
from mlx_server.models.vision import VisionPromptBuilder
from mlx_server.types import SamplingParams


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Any:
    loaded = load_model(str(build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-vlm")))
    assert loaded.capabilities == ["vision"] and loaded.processor is not None
    return loaded


@pytest.fixture
def engine(vlm):
    eng = vision_engine(vlm.model, vlm.tokenizer, EngineConfig(kv_bytes_per_token=256))
    eng.start()
    yield eng
    eng.shutdown(timeout=10)


def prompt(vlm, color=(255, 0, 0), size: int = 56, image: bool = True) -> tuple[list[int], Any]:
    """(token ids, vision inputs) for a one-image question, through the prompt builder."""
    builder = VisionPromptBuilder(vlm.processor, vlm.config, MediaLimits())
    content: list[dict[str, Any]] = [{"type": "text", "text": "What colour is it?"}]
    if image:
        buf = io.BytesIO()
        Image.new("RGB", (size, size), color).save(buf, "PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        content.insert(0, {"type": "image", "image": url})
    messages = [{"role": "user", "content": content}]
    text = render_prompt(vlm.tokenizer, builder.template_messages(messages))
    tokens, inputs = builder.encode(text, messages)
    if inputs is not None:
        inputs.pop("cache_tokens")  # (without its key, a request's state is not cached)
    return tokens, inputs


def test_pixels_reach_the_model(vlm, engine):
    async def first_token(color):
        tokens, inputs = prompt(vlm, color)
        req = request(tokens, 1, vision_inputs=inputs, logprobs=True, top_logprobs=5)
        return (await generate(engine, req)).logprobs[0]

    red, blue, red_again = (
        drive(engine, first_token(c)) for c in [(255, 0, 0), (0, 0, 255), (255, 0, 0)]
    )
    assert red == red_again
    assert red.top != blue.top  # a different picture, a different next-token distribution


def test_usage_counts_image_tokens_and_max_tokens(vlm, engine):
    tokens, inputs = prompt(vlm, size=112)
    text_tokens, none = prompt(vlm, image=False)
    assert none is None and len(tokens) == len(text_tokens) + 2 + 16
    r = drive(engine, generate(engine, request(tokens, 5, vision_inputs=inputs)))
    assert r.reason == "length"
    assert r.finished.usage.prompt_tokens == len(tokens)
    assert r.finished.usage.completion_tokens == 5
    assert r.finished.timings.prompt_n == len(tokens) and r.finished.timings.predicted_n == 5
    text_only = drive(engine, generate(engine, request(text_tokens, 3)))
    assert text_only.reason == "length" and text_only.finished.usage.prompt_tokens == len(
        text_tokens
    )


def test_seeded_sampling_repeats(vlm, engine):
    tokens, inputs = prompt(vlm)
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=3)

    def once():
        return drive(
            engine, generate(engine, request(tokens, 8, vision_inputs=inputs, sampling=sampling))
        )

    assert once().text == once().text


def batched(engine, reqs):
    """Results of ``reqs`` admitted together: the engine thread is held while they queue."""
    release = threading.Event()
    held = engine.call(release.wait)

    async def main():
        handles = [engine.submit(r) for r in reqs]
        release.set()
        return await asyncio.gather(*(collect(h) for h in handles))

    try:
        return drive(engine, main())
    finally:
        release.set()
        held.result(timeout=10)


def one_at_a_time(vlm, reqs):
    """Results of ``reqs`` through mlx-vlm's ``generate_step`` (the one-at-a-time runner)."""
    eos = sorted(vlm.tokenizer.eos_token_ids)
    serial = Engine(
        vlm.model,
        vlm.tokenizer,
        EngineConfig(kv_bytes_per_token=256, prompt_cache_size=0, max_batch_size=1, solo=False),
        runner=VisionRunner(vlm.model, eos, prefill_step_size=512),
    )
    serial.start()
    try:
        return [drive(serial, generate(serial, r)) for r in reqs]
    finally:
        serial.shutdown(timeout=10)


def test_the_next_turn_continues_from_the_cached_image(vlm, engine):
    """Turn two's image is in the prefix cache: it runs on the text path (the lone runner)
    from the cached state and its position delta, and gives what mlx-vlm gives."""
    image = {"type": "image", "image": "data:image/png;base64," + base64.b64encode(_png()).decode()}
    messages = [
        {"role": "user", "content": [image, {"type": "text", "text": "Colour?"}]},
        {"role": "assistant", "content": "Green, I think."},
        {"role": "user", "content": "Sure?"},
    ]
    builder = VisionPromptBuilder(vlm.processor, vlm.config, MediaLimits())
    encoded = []
    for turn in (messages[:1], messages):
        text = render_prompt(vlm.tokenizer, builder.template_messages(turn))
        tokens, inputs = builder.encode(text, turn)
        key = inputs.pop("cache_tokens")
        encoded.append(
            request(
                tokens, 3, vision_inputs=inputs, cache_tokens=key, logprobs=True, top_logprobs=3
            )
        )
    first = drive(engine, generate(engine, encoded[0]))
    solo_runs = engine.stats()["solo_runs"]
    second = drive(engine, generate(engine, encoded[1]))
    assert second.cached >= len(encoded[0].prompt_tokens) - 1
    assert engine.stats()["solo_runs"] == solo_runs + 1
    # The same distributions (a wrong delta shifts them by ~0.1; the paths agree to ~1e-6).
    for ours, theirs in zip([first, second], one_at_a_time(vlm, encoded), strict=True):
        assert [[t.logprob for t in e.top] for e in ours.logprobs] == [
            pytest.approx([t.logprob for t in e.top], abs=1e-3) for e in theirs.logprobs
        ]


def test_images_and_text_share_the_batch_with_their_own_positions(vlm, engine):
    """Qwen2-VL's positions run behind the token count after an image (M-RoPE): each
    sequence in the batch keeps its own, so each gives what mlx-vlm's own ``generate_step``
    gives (the one-at-a-time runner)."""
    tokens, inputs = prompt(vlm)
    wide, wide_inputs = prompt(vlm, (0, 0, 255), size=112)
    text, _ = prompt(vlm, image=False)
    reqs = [
        request(tokens, 6, vision_inputs=inputs, ignore_eos=True),
        request(wide, 6, vision_inputs=wide_inputs, ignore_eos=True),
        request(text, 6, ignore_eos=True),
    ]
    green, green_inputs = prompt(vlm, (0, 255, 0), size=112)
    lone = request(green, 6, vision_inputs=green_inputs, ignore_eos=True)
    *alone, serial_lone = one_at_a_time(vlm, [*reqs, lone])
    together = batched(engine, [replace(r, request_id=r.request_id + "-b") for r in reqs])
    assert engine.stats()["peak_batch"] == 3
    assert [r.text for r in together] == [r.text for r in alone]
    assert all(r.reason == "length" and r.cached == 0 for r in together)
    # Alone, a prefilled image prompt decodes on the lone runner, as text prompts do.
    runs = engine.stats()["solo_runs"]
    assert drive(engine, generate(engine, lone)).text == serial_lone.text
    assert engine.stats()["solo_runs"] == runs + 1


def test_cancel_queued_and_running(vlm, engine):
    tokens, inputs = prompt(vlm)
    long = request(tokens, 2000, vision_inputs=inputs)
    queued = request(tokens, 5, vision_inputs=inputs)

    async def main():
        h_long, h_queued = engine.submit(long), engine.submit(queued)
        assert engine.cancel(queued.request_id) == 1
        first = await h_long.__aiter__().__anext__()  # the long one is generating
        assert first is not None
        assert engine.cancel() == 1  # only the running one is left to cancel
        return await collect(h_long), await collect(h_queued)

    r_long, r_queued = drive(engine, main())
    assert r_queued.reason == "cancelled" and r_queued.finished.usage.completion_tokens == 0
    assert r_long.reason == "cancelled" and r_long.finished.usage.completion_tokens < 2000
    assert engine.active_count == 0 and engine.queue_depth == 0
    assert engine.stats()["mode"] == "batch"


def test_a_failing_request_does_not_stop_the_engine(vlm, engine):
    tokens, inputs = prompt(vlm)
    broken = dict(inputs, image_grid_thw=inputs["image_grid_thw"] * 3)  # more patches than pixels
    r = drive(engine, generate(engine, request(tokens, 4, vision_inputs=broken)))
    assert r.reason == "error" and r.finished.error
    ok = drive(engine, generate(engine, request(tokens, 4, vision_inputs=inputs)))
    assert ok.reason == "length"


def test_shutdown_refuses_new_requests(vlm):
    eng = vision_engine(vlm.model, vlm.tokenizer, EngineConfig(kv_bytes_per_token=256))
    eng.start()
    eng.shutdown(timeout=10)
    tokens, inputs = prompt(vlm)

    async def submit():
        eng.submit(request(tokens, 4, vision_inputs=inputs))

    with pytest.raises(Overloaded):
        drive(eng, submit())


def test_images_in_tool_results_need_a_template_that_shows_them(vlm):
    from mlx_server.errors import InvalidRequest

    builder = VisionPromptBuilder(vlm.processor, vlm.config, MediaLimits())
    url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    messages = [
        {"role": "user", "content": "Look."},
        {"role": "tool", "content": [{"type": "image", "image": url}], "tool_call_id": "c1"},
    ]
    shown = render_prompt(vlm.tokenizer, builder.template_messages(messages))
    tokens, inputs = builder.encode(shown, messages)
    assert inputs is not None and "<|image_pad|>" in shown
    hidden = shown.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
    with pytest.raises(InvalidRequest) as e:
        builder.encode(hidden, messages)
    assert e.value.param == "messages[1].content[0]" and "tool results" in e.value.message


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (0, 200, 0)).save(buf, "PNG")
    return buf.getvalue()
