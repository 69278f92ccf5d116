"""The chat service with a second architecture, Idefics3 (SmolVLM's): its processor tiles
each image and writes row/column markers, so an image costs many tokens; the service must
count them, check them against the context, and run the request on the vision runner."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
from engine_runner import drive, vision_engine
from PIL import Image
from tiny_vlm import build_tiny_idefics3

from mlx_server.engine.core.engine import EngineConfig
from mlx_server.engine.core.handle import Started
from mlx_server.errors import ContextLengthExceeded, InvalidRequest
from mlx_server.events import Finished, Logprobs, TextDelta
from mlx_server.models.loader import load_model
from mlx_server.models.media import MediaLimits
from mlx_server.models.vision import VisionPromptBuilder
from mlx_server.service import ChatService
from mlx_server.types import ChatRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Any:
    loaded = load_model(str(build_tiny_idefics3(tmp_path_factory.mktemp("vlm") / "idefics3")))
    assert loaded.capabilities == ["vision"]
    engine = vision_engine(loaded.model, loaded.tokenizer, EngineConfig(kv_bytes_per_token=256))
    vision = VisionPromptBuilder(loaded.processor, loaded.config, MediaLimits())
    svc = ChatService(loaded.model_id, loaded.tokenizer, engine, ctx_size=400, vision=vision)
    engine.start()
    yield svc
    engine.shutdown(timeout=10)


def image(color=(255, 0, 0), w: int = 56, h: int = 56) -> dict[str, Any]:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, "PNG")
    return {
        "type": "image",
        "image": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(),
    }


def ask(*media: dict[str, Any], text: str = "What is it?") -> dict[str, Any]:
    return {"role": "user", "content": [*media, {"type": "text", "text": text}]}


def chat(*messages: dict[str, Any], **kw: Any) -> ChatRequest:
    kw.setdefault("sampling", GREEDY)
    return ChatRequest(messages=list(messages), **kw)


def run(service: ChatService, req: ChatRequest) -> tuple[str, Finished]:
    async def main():
        text, final = "", None
        async for ev in (await service.start(req)).events():
            if isinstance(ev, TextDelta):
                text += ev.text
            elif isinstance(ev, Finished):
                final = ev
            else:
                assert isinstance(ev, Logprobs | Started)
        return text, final

    return drive(service.engine, main())


def test_image_tokens_per_image_and_per_turn(service):
    plain = service.count_tokens(chat(ask()))
    one = service.count_tokens(chat(ask(image())))
    two = service.count_tokens(chat(ask(image(), image((0, 0, 255)))))
    per_image = one - plain
    assert per_image > 20  # 4 tiles and a global view, with their markers
    assert two == plain + 2 * per_image
    wide = service.count_tokens(chat(ask(image(w=56, h=28))))
    assert plain < wide < one  # 2 tiles instead of 4
    earlier = chat(ask(image()), {"role": "assistant", "content": "red"}, ask(text="Sure?"))
    later = chat(ask(), {"role": "assistant", "content": "red"}, ask(text="Sure?"))
    assert service.count_tokens(earlier) == service.count_tokens(later) + per_image


def test_generation_uses_the_image_and_counts_it(service):
    req = chat(ask(image()), max_tokens=6)
    text, final = run(service, req)
    assert final.reason == "length" and final.usage.completion_tokens == 6
    assert final.usage.prompt_tokens == service.count_tokens(req)
    assert text == run(service, req)[0]  # greedy
    blue, _ = run(service, chat(ask(image((0, 0, 255))), max_tokens=6))
    assert blue != text


def test_context_check_includes_image_tokens(service):
    n = service.count_tokens(chat(ask(image(), image(), image())))
    assert n > 150
    with pytest.raises(ContextLengthExceeded) as e:
        service.prepare(chat(ask(image(), image(), image()), max_tokens=400 - n + 1))
    assert f"prompt {n} tokens" in e.value.message and e.value.n_prompt_tokens == n
    assert service.prepare(chat(ask(image(), image(), image()), max_tokens=400 - n)).tokens


def test_media_outside_user_messages_is_refused(service):
    system = {"role": "system", "content": [{"type": "text", "text": "hi"}, image()]}
    with pytest.raises(InvalidRequest) as e:
        service.count_tokens(chat(system, ask()))
    assert e.value.param == "messages[0].content[1]"


def test_video_to_an_image_only_model_is_refused(service):
    video = {"type": "video", "video": "/tmp/clip.mp4", "param": "messages[0].videos[0]"}
    with pytest.raises(InvalidRequest) as e:
        service.count_tokens(chat(ask(video)))
    assert e.value.param == "messages[0].videos[0]" and "does not accept video" in e.value.message


def test_end_of_utterance_ends_the_turn(service):
    eou = service.tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    assert eou in service.tokenizer.eos_token_ids  # declared by the processor, not the config
    assert eou in service.engine.eos_ids


def test_media_are_fetched_off_the_loop_and_processed_on_the_engine_thread(service, monkeypatch):
    """Fetching and decoding run in a worker thread, never on the event loop; the processor,
    which makes MLX arrays, runs on the engine thread that owns MLX."""
    import threading

    from mlx_server.models import vision

    seen: dict[str, str] = {}
    collect, model_inputs = vision.collect_media, vision.VisionPromptBuilder._model_inputs

    def spy_collect(*a, **k):
        seen["collect"] = threading.current_thread().name
        return collect(*a, **k)

    def spy_inputs(self, *a, **k):
        seen["process"] = threading.current_thread().name
        return model_inputs(self, *a, **k)

    monkeypatch.setattr(vision, "collect_media", spy_collect)
    monkeypatch.setattr(vision.VisionPromptBuilder, "_model_inputs", spy_inputs)
    loop_thread = threading.current_thread().name  # asyncio.run runs the loop here
    text, final = run(service, chat(ask(image()), max_tokens=2))
    assert final.reason in ("length", "stop") and final.usage.prompt_tokens > 20
    assert seen["process"] == "mlx-engine"
    assert seen["collect"] not in (loop_thread, "mlx-engine")
