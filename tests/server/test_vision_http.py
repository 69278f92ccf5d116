"""Vision over HTTP in process: the real stack over the real engine on a tiny random-weight
Qwen2-VL, through the OpenAI and Anthropic SDKs: one and two images, streamed and not, and
admission counting the vision tower's memory (a budget of 512 KiB: a 56x56 image's tower
fits beside the KV, a 224x224 one's cannot, and is refused with each protocol's envelope).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from clients import anthropic_client, openai_client
from PIL import Image
from support import serve_in_process
from tiny_vlm import build_tiny_vlm

from mlx_server.boot.app import app_options, create_app
from mlx_server.boot.chat import load_chat_model
from mlx_server.config import Settings
from mlx_server.engine.core.scheduler import MEDIA_REFUSAL_DIVISOR
from mlx_server.engine.runners.vision_memory import tower_bytes

BUDGET_GB = 1 / 2048  # 512 KiB


def png(side: int, color=(200, 30, 30)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), color).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def openai_images(*images: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b}"}} for b in images
    ]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]


def anthropic_images(*images: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b}}
        for b in images
    ]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[Any]:
    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-vlm")
    settings = Settings(model=str(path), kv_budget_gb=BUDGET_GB, ctx_size=1024, prompt_cache_dir="")
    parts = load_chat_model(settings)
    server = serve_in_process(
        create_app(parts.service, **app_options(settings, vision=True)),
        parts.engine,
        parts.service,
    )
    yield server
    server.stop()
    parts.engine.shutdown(timeout=10)


def test_the_tower_estimate_sets_the_small_image_in_and_the_large_one_out(srv):
    """The premise of the tests below, in the model's own terms."""
    import mlx.core as mx

    vlm = srv.engine._runner.vlm  # the batch runner's vision model

    def estimate(side: int) -> int:
        n = (side // 14) ** 2
        inputs = {
            "pixel_values": mx.zeros((n, 3 * 2 * 14 * 14)),
            "image_grid_thw": mx.array([[1, side // 14, side // 14]]),
        }
        return tower_bytes(vlm, inputs)

    budget = int(BUDGET_GB * (1 << 30))
    assert 2 * estimate(56) < budget // 2 < budget < estimate(224) // MEDIA_REFUSAL_DIVISOR


@pytest.mark.parametrize("stream", [False, True])
def test_openai_image_beyond_the_towers_memory_is_a_413(srv, stream):
    body = {"model": "m", "messages": openai_images(png(224)), "max_tokens": 4, "stream": stream}
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert "vision tower" in error["message"] and "--kv-budget-gb" in error["message"]
    assert error["type"] == "request_too_large" and error["param"] == "messages"


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_image_beyond_the_towers_memory_is_a_413(srv, stream):
    body = {
        "model": "m",
        "messages": anthropic_images(png(224)),
        "max_tokens": 4,
        "stream": stream,
    }
    r = httpx.post(f"{srv.base_url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 413, r.text
    answer = r.json()
    assert answer["type"] == "error" and answer["error"]["type"] == "request_too_large"
    assert "vision tower" in answer["error"]["message"]


def test_a_small_image_within_the_budget_is_served_by_both_apis(srv):
    body = {"model": "m", "messages": openai_images(png(56)), "max_tokens": 3}
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", json={**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    body = {"model": "m", "messages": anthropic_images(png(56)), "max_tokens": 3}
    r = httpx.post(f"{srv.base_url}/v1/messages", json={**body, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] == 3


@pytest.mark.parametrize("n_images", [1, 2])
def test_openai_images_streamed_and_not(srv, n_images):
    client = openai_client(srv)
    messages = openai_images(*[png(56, (40 * i, 90, 200)) for i in range(n_images)])
    kw: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 5, "temperature": 0}
    kw["extra_body"] = {"ignore_eos": True}
    done = client.chat.completions.create(**kw)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 5
    options = {"include_usage": True}
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options=options))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text == done.choices[0].message.content  # greedy: the same answer either way
    assert usage.prompt_tokens == done.usage.prompt_tokens and usage.completion_tokens == 5
    assert done.usage.prompt_tokens >= 4 * n_images + 8  # each 56x56 image is 4 tokens


@pytest.mark.parametrize("n_images", [1, 2])
def test_anthropic_images_streamed_and_not(srv, n_images):
    client = anthropic_client(srv)
    messages = anthropic_images(*[png(56, (40 * i, 90, 200)) for i in range(n_images)])
    extra = {"ignore_eos": True, "temperature": 0}  # (not among this SDK's arguments)
    done = client.messages.create(model="m", messages=messages, max_tokens=5, extra_body=extra)
    assert done.stop_reason == "max_tokens" and done.usage.output_tokens == 5
    with client.messages.stream(model="m", messages=messages, max_tokens=5, extra_body=extra) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "".join(b.text for b in done.content if b.type == "text")
    assert final.usage.output_tokens == 5 and final.stop_reason == "max_tokens"
    seen = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    assert seen == done.usage.input_tokens + (done.usage.cache_read_input_tokens or 0)


def test_two_images_take_more_prompt_than_one(srv):
    client = openai_client(srv)
    sizes = []
    for n in (1, 2):
        messages = openai_images(*[png(56, (0, 60 * i, 90)) for i in range(n)])
        done = client.chat.completions.create(model="m", messages=messages, max_tokens=1)
        sizes.append(done.usage.prompt_tokens)
    assert sizes[1] - sizes[0] >= 4  # the second image's tokens (and its markers)
