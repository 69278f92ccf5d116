"""Vision end to end: a real ``mlx-server`` process on a tiny random-weight Qwen2-VL model,
driven with the official OpenAI and Anthropic SDKs.

The tiny model's processor gives an image (h/14)*(w/14)/4 tokens (56x56 → 4, 112x112 → 16),
between <|vision_start|> and <|vision_end|>; the tests check the counts, not the wording.
"""

from __future__ import annotations

import base64
import io
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from clients import anthropic_client, openai_client
from PIL import Image
from support import free_port, launch, serving
from tiny_vlm import build_tiny_vlm

QUESTION = "What is in the picture?"
MAX_IMAGES, MAX_MB, MAX_PIXELS, CTX = 3, 1, 250_000, 1024


def png(w: int, h: int, color=(220, 40, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict, text: str = QUESTION) -> dict:
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-vlm")


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("media")
    (d / "red 56.png").write_bytes(png(56, 56))
    (d / "notes.txt").write_text("not an image")
    return d


@pytest.fixture(scope="module")
def vlm_server(vlm_dir) -> Iterator:
    args = ["-m", str(vlm_dir), "--ctx-size", str(CTX)]
    args += ["--max-images", str(MAX_IMAGES), "--max-image-mb", str(MAX_MB)]
    args += ["--max-image-pixels", str(MAX_PIXELS)]
    with serving(args) as sp:
        yield sp


def prompt_tokens(srv, messages: list[dict]) -> int:
    r = openai_client(srv).chat.completions.create(
        model="tiny-vlm", messages=messages, max_tokens=2, temperature=0
    )
    assert r.usage is not None
    return r.usage.prompt_tokens


def post(srv, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=60)


def still_answers(srv) -> None:
    assert prompt_tokens(srv, [{"role": "user", "content": "hello"}]) > 0


# ---- OpenAI: images counted in usage -------------------------------------------------------


def test_models_list_the_vision_capability(vlm_server):
    data = httpx.get(vlm_server.base_url + "/v1/models").json()["data"]
    assert data[0]["id"] == "tiny-vlm" and data[0]["capabilities"] == ["vision"]


def test_image_tokens_are_counted_and_grow_with_pixels(vlm_server):
    text_only = prompt_tokens(vlm_server, [{"role": "user", "content": QUESTION}])
    small = prompt_tokens(vlm_server, [user(image_part(data_url(png(56, 56))))])
    large = prompt_tokens(vlm_server, [user(image_part(data_url(png(112, 112))))])
    assert small == text_only + 2 + 4  # vision start/end + 4 image tokens
    assert large == small + 12  # 16 image tokens instead of 4


def test_file_url_and_path_count_like_the_data_url(vlm_server, media_dir):
    path = media_dir / "red 56.png"
    by_data = prompt_tokens(vlm_server, [user(image_part(data_url(path.read_bytes())))])
    encoded = "file://" + str(path).replace(" ", "%20")
    assert prompt_tokens(vlm_server, [user(image_part(encoded))]) == by_data
    assert prompt_tokens(vlm_server, [user(image_part(str(path)))]) == by_data
    legacy = {"role": "user", "content": QUESTION, "images": [str(path)]}
    assert prompt_tokens(vlm_server, [legacy]) == by_data


def test_two_images_in_one_message(vlm_server):
    one = prompt_tokens(vlm_server, [user(image_part(data_url(png(56, 56))))])
    two = prompt_tokens(
        vlm_server,
        [user(image_part(data_url(png(56, 56))), image_part(data_url(png(112, 112))))],
    )
    assert two == one + 2 + 16


def test_image_in_an_earlier_turn(vlm_server):
    turns = [
        {"role": "assistant", "content": "A red square."},
        {"role": "user", "content": "Are you sure?"},
    ]
    without = prompt_tokens(vlm_server, [{"role": "user", "content": QUESTION}, *turns])
    with_image = prompt_tokens(vlm_server, [user(image_part(data_url(png(56, 56)))), *turns])
    assert with_image == without + 2 + 4


def test_the_same_image_next_turn_comes_from_the_prefix_cache(vlm_server):
    c = openai_client(vlm_server)
    kw = dict(model="tiny-vlm", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})

    def first(color) -> dict:
        return user(image_part(data_url(png(112, 112, color))), text="Turn one, this picture.")

    one = c.chat.completions.create(messages=[first((0, 200, 0))], **kw)
    answer = {"role": "assistant", "content": one.choices[0].message.content}
    two = c.chat.completions.create(messages=[first((0, 200, 0)), answer, user(text="And?")], **kw)
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens - 1
    # The same text with another picture: only what comes before the image is served.
    other = c.chat.completions.create(messages=[first((120, 0, 120))], **kw)
    assert other.usage.prompt_tokens_details.cached_tokens < 8


def test_streaming_with_an_image(vlm_server):
    messages = [user(image_part(data_url(png(112, 112))))]
    stream = openai_client(vlm_server).chat.completions.create(
        model="tiny-vlm",
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    usage = chunks[-1].usage
    assert finish in (["length"], ["stop"]) and usage is not None
    assert usage.prompt_tokens == prompt_tokens(vlm_server, messages)
    full = openai_client(vlm_server).chat.completions.create(
        model="tiny-vlm", messages=messages, max_tokens=6, temperature=0
    )
    assert text == full.choices[0].message.content  # greedy: the same text either way
    assert usage.completion_tokens == full.usage.completion_tokens <= 6


def test_sampling_seed_and_stop_strings(vlm_server):
    c = openai_client(vlm_server)
    messages = [user(image_part(data_url(png(56, 56))))]
    kw = dict(model="tiny-vlm", messages=messages, max_tokens=8)
    a = c.chat.completions.create(**kw, temperature=1.0, seed=7).choices[0].message.content
    b = c.chat.completions.create(**kw, temperature=1.0, seed=7).choices[0].message.content
    assert a == b
    # Greedy, never ending early: the stop string is cut from a text of 8 tokens.
    kw["extra_body"] = {"ignore_eos": True}
    greedy = c.chat.completions.create(**kw, temperature=0).choices[0]
    text = greedy.message.content or ""
    assert len(text) >= 3, text
    stop = text[1:3]
    cut = c.chat.completions.create(**kw, temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == text[: text.index(stop)]


def test_structured_output_with_an_image(vlm_server):
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string", "enum": ["red", "blue"]}},
        "required": ["color"],
    }
    r = openai_client(vlm_server).chat.completions.create(
        model="tiny-vlm",
        messages=[user(image_part(data_url(png(56, 56))))],
        max_tokens=500,  # random weights: whitespace up to the grammar's bound in every gap
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    assert r.choices[0].finish_reason == "stop", repr(r.choices[0].message.content)
    assert json.loads(r.choices[0].message.content or "")["color"] in ("red", "blue")


def test_context_check_counts_image_tokens(vlm_server):
    messages = [user(image_part(data_url(png(224, 224))))]
    n = prompt_tokens(vlm_server, messages)
    text_n = prompt_tokens(vlm_server, [{"role": "user", "content": QUESTION}])
    assert n == text_n + 2 + 64
    r = post(vlm_server, {"messages": messages, "max_tokens": CTX - n + 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert f"prompt {n} tokens" in err["message"] and err["n_prompt_tokens"] == n


def test_video_file_and_legacy_videos(vlm_server, tmp_path):
    import cv2  # comes with mlx-vlm
    import numpy as np

    path = tmp_path / "clip.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 4, (56, 56))
    for i in range(8):
        writer.write(np.full((56, 56, 3), i * 30, np.uint8))
    writer.release()
    text_only = prompt_tokens(vlm_server, [{"role": "user", "content": QUESTION}])
    part = {"type": "video_url", "video_url": {"url": f"file://{path}"}}
    with_video = prompt_tokens(vlm_server, [user(part)])
    assert with_video > text_only + 2
    legacy = {"role": "user", "content": QUESTION, "videos": [str(path)]}
    assert prompt_tokens(vlm_server, [legacy]) == with_video


def test_cancelled_stream_frees_the_engine(vlm_server):
    since = len(vlm_server.lines)
    body = {
        "messages": [user(image_part(data_url(png(56, 56))))],
        "max_tokens": CTX - 100,
        "stream": True,
        "temperature": 1.0,
        "stop": [],
        "ignore_eos": True,  # the random model's sampled end-of-turn never cuts it short
    }
    with httpx.stream(
        "POST", vlm_server.base_url + "/v1/chat/completions", json=body, timeout=60
    ) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        seen = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: ") for line in seen)
    deadline = time.time() + 20
    while time.time() < deadline:
        if httpx.get(vlm_server.base_url + "/health").json()["active"] == 0:
            break
        time.sleep(0.1)
    health = httpx.get(vlm_server.base_url + "/health").json()
    assert (health["status"], health["active"], health["queued"]) == ("ok", 0, 0)
    line = vlm_server.wait_for_line(" cancelled ", since)  # cut short, not run to its end
    assert int(line.rsplit(", ", 1)[1].split()[0]) < CTX - 100, line
    still_answers(vlm_server)


# ---- bad inputs: each a 400 naming the part ------------------------------------------------


def _too_many_pixels() -> str:
    return data_url(png(600, 600))


def _too_many_bytes() -> str:
    return data_url(os.urandom(int(1.2 * (1 << 20))))


def _ppm() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "PPM")
    return data_url(buf.getvalue(), "image/x-portable-pixmap")


BAD_IMAGES = {
    "undecodable": (lambda d: "data:image/png;base64,!!notbase64!!", "not valid base64"),
    "truncated": (lambda d: data_url(png(64, 64)[:100]), "could not be decoded"),
    "format": (lambda d: _ppm(), "supported format"),
    "remote": (lambda d: "https://example.com/cat.png", "--allow-remote-images"),
    "bytes": (lambda d: _too_many_bytes(), "limit of 1.0 MB"),
    "pixels": (lambda d: _too_many_pixels(), "360,000 pixels"),
    "missing": (lambda d: str(d / "nope.png"), "does not exist"),
    "not-an-image": (lambda d: f"file://{d / 'notes.txt'}", "supported format"),
    "relative": (lambda d: "pictures/cat.png", "unsupported media URL"),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_bad_image_is_a_400_naming_the_part(vlm_server, media_dir, case):
    make, words = BAD_IMAGES[case]
    good = image_part(data_url(png(56, 56)))
    messages = [{"role": "system", "content": "Be brief."}, user(good, image_part(make(media_dir)))]
    r = post(vlm_server, {"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == "messages[1].content[1]"
    assert err["message"].startswith("messages[1].content[1]: ") and words in err["message"]
    still_answers(vlm_server)


def test_too_many_images_and_misplaced_images(vlm_server):
    part = image_part(data_url(png(56, 56)))
    r = post(vlm_server, {"messages": [user(*[part] * (MAX_IMAGES + 1))], "max_tokens": 2})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == f"messages[0].content[{MAX_IMAGES}]"
    assistant = {"role": "assistant", "content": [part]}
    r = post(vlm_server, {"messages": [user(), assistant, user()], "max_tokens": 2})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[1].content[0]"
    assert "accepted in user messages and tool results only" in r.json()["error"]["message"]
    legacy = {"role": "user", "content": "hi", "images": ["/no/such.png"]}
    r = post(vlm_server, {"messages": [legacy], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].images[0]"
    not_video = {"role": "user", "content": "x", "videos": [__file__]}
    r = post(vlm_server, {"messages": [not_video], "max_tokens": 2})
    assert r.status_code == 400 and "not a video" in r.json()["error"]["message"]
    still_answers(vlm_server)


# ---- Anthropic -----------------------------------------------------------------------------


def _ant_image(data: bytes) -> dict:
    b64 = base64.b64encode(data).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}


def _input(usage) -> int:
    """A prompt's tokens: Anthropic's ``input_tokens`` leave out those read from the cache."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_anthropic_images_are_counted(vlm_server, media_dir):
    c = anthropic_client(vlm_server)
    kw = dict(model="tiny-vlm", max_tokens=4, extra_body={"temperature": 0})
    text = c.messages.create(**kw, messages=[{"role": "user", "content": QUESTION}])
    content = [_ant_image(png(56, 56)), {"type": "text", "text": QUESTION}]
    msg = c.messages.create(**kw, messages=[{"role": "user", "content": content}])
    assert _input(msg.usage) == _input(text.usage) + 2 + 4
    counted = c.messages.count_tokens(
        model="tiny-vlm", messages=[{"role": "user", "content": content}]
    )
    assert counted.input_tokens == _input(msg.usage)
    url = {"type": "image", "source": {"type": "url", "url": f"file://{media_dir / 'red 56.png'}"}}
    by_url = c.messages.create(
        **kw, messages=[{"role": "user", "content": [url, {"type": "text", "text": QUESTION}]}]
    )
    assert _input(by_url.usage) == _input(msg.usage)
    two = [_ant_image(png(56, 56)), _ant_image(png(112, 112)), {"type": "text", "text": QUESTION}]
    msg2 = c.messages.create(**kw, messages=[{"role": "user", "content": two}])
    assert _input(msg2.usage) == _input(msg.usage) + 2 + 16


def test_anthropic_image_in_a_tool_result(vlm_server):
    tools = [{"name": "screenshot", "description": "Take one", "input_schema": {"type": "object"}}]
    call = {"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}

    def turns(result: list[dict]) -> list[dict]:
        return [
            {"role": "user", "content": "Look at the screen."},
            {"role": "assistant", "content": [call]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}],
            },
        ]

    c = anthropic_client(vlm_server)
    text = [{"type": "text", "text": "done"}]
    plain = c.messages.count_tokens(model="m", tools=tools, messages=turns(text)).input_tokens
    shot = c.messages.count_tokens(
        model="m", tools=tools, messages=turns([_ant_image(png(112, 112)), *text])
    ).input_tokens
    assert shot == plain + 2 + 16
    msg = c.messages.create(
        model="m", max_tokens=3, tools=tools, messages=turns([_ant_image(png(112, 112)), *text])
    )
    assert _input(msg.usage) == shot


def test_anthropic_stream_with_an_image(vlm_server):
    content = [_ant_image(png(112, 112)), {"type": "text", "text": QUESTION}]
    kw = dict(
        model="tiny-vlm",
        max_tokens=5,
        messages=[{"role": "user", "content": content}],
        extra_body={"temperature": 0},
    )
    c = anthropic_client(vlm_server)
    with c.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    whole = c.messages.create(**kw)
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_anthropic_bad_image_is_a_400(vlm_server):
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
    }
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [block]}]}
    r = post(vlm_server, body, "/v1/messages")
    assert r.status_code == 400
    assert r.json()["type"] == "error"
    assert r.json()["error"]["message"].startswith("messages[0].content[0]: ")
    # A system prompt becomes the first template message; errors still name the request's place.
    text = {"type": "text", "text": "hi"}
    body["system"] = "Be brief."
    body["messages"] = [{"role": "user", "content": [text, block]}]
    r = post(vlm_server, body, "/v1/messages")
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("messages[0].content[1]: ")
    still_answers(vlm_server)


# ---- text-only models and missing vision support -----------------------------------------


def test_images_to_a_text_only_model_are_400s(scripted):
    body = {"messages": [user(image_part(data_url(png(8, 8))))], "max_tokens": 2}
    r = post(scripted, body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[0].content[0]"
    assert "text only" in r.json()["error"]["message"]
    block = _ant_image(png(8, 8))
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [block]}]}
    r = post(scripted, body, "/v1/messages")
    assert r.status_code == 400 and "text only" in r.json()["error"]["message"]


def test_a_vlm_without_mlx_vlm_names_the_install_command(vlm_dir, monkeypatch):
    import sys

    from mlx_server.models.loader import ModelLoadError, load_model

    monkeypatch.setitem(sys.modules, "mlx_vlm", None)  # import mlx_vlm → ImportError
    with pytest.raises(ModelLoadError) as e:
        load_model(str(vlm_dir))
    assert "pip install 'mlx-server[vision]'" in str(e.value)


def test_text_server_runs_without_vision_packages(tmp_path, tiny_model_dir, vlm_dir):
    # Stand-ins that fail on import, first on the path: as if mlx-vlm and Pillow were absent.
    for name in ("mlx_vlm", "PIL", "cv2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('no {name} here')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    text = launch(["-m", str(tiny_model_dir), "--port", str(free_port())], env)
    try:
        assert text.wait_ready(), text.lines
        assert prompt_tokens(text, [{"role": "user", "content": "hello"}]) > 0
    finally:
        text.stop()
    vlm = launch(["-m", str(vlm_dir), "--port", str(free_port())], env)
    try:
        assert not vlm.wait_ready(60)
        assert vlm.proc.wait(30) == 1
        assert any("pip install 'mlx-server[vision]'" in line for line in vlm.lines), vlm.lines
    finally:
        vlm.stop()
