"""Several models in one server process: the demo model and tiny test models by id, load on
first request, unload by memory, keep_alive and idle time, pins, the management routes and
unknown ids on every API."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from support import demo_model_dir, free_port, launch
from test_vision_server import data_url, image_part, png
from tiny_model import build_tiny_model
from tiny_vlm import build_tiny_vlm

KEY = "registry-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Each model counts its weights and KV budget: small, so a budget of a few models is too.
SMALL = ["--ctx-size", "256", "--kv-budget-gb", "0.01", "--prompt-cache-gb", "0.01"]
SMALL += ["--prompt-cache-dir", ""]
CTX = 1024  # room for an image's tokens
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "ignore_eos": True}


def start(args: list[str]):
    port = free_port()
    srv = launch([*SMALL, *args, "--port", str(port)])
    assert srv.wait_ready(300), srv.lines
    return srv


def statuses(srv, headers=None) -> dict[str, str]:
    data = httpx.get(srv.base_url + "/v1/models", headers=headers or {}).json()["data"]
    return {m["id"]: m["status"] for m in data}


def until(condition, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "condition not met before the deadline"
        time.sleep(0.1)


def chat(srv, model: str, headers=None, **extra) -> httpx.Response:
    body = {"model": model, **CHAT, **extra}
    return httpx.post(
        srv.base_url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=120
    )


# Servers of several models (up to 300 s to start) and first requests that load a model.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for i, name in enumerate(("tiny-a", "tiny-b", "tiny-c")):
        build_tiny_model(root / name, seed=i)
    return root


@pytest.fixture(scope="module")
def many(tiny_dir, tmp_path_factory):
    """The demo model, two tiny ones and a tiny vision model; tiny-a pinned; with a key."""
    demo = demo_model_dir(float32=False)
    vlm = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-vlm")
    args = ["-m", str(demo), "-m", str(tiny_dir / "tiny-a"), "-m", str(tiny_dir / "tiny-b")]
    args += ["-m", str(vlm), "--ctx-size", str(CTX)]
    srv = start([*args, "--pin", "tiny-a", "--api-key", KEY])
    yield srv
    srv.stop()


@pytest.mark.demo  # the shared server serves the demo model
def test_listing_pinned_loaded_at_start_and_the_others_on_first_request(many):
    demo = demo_model_dir(float32=False).name
    data = httpx.get(many.base_url + "/v1/models", headers=AUTH).json()["data"]
    assert [m["id"] for m in data] == [demo, "tiny-a", "tiny-b", "tiny-vlm"]
    by_id = {m["id"]: m for m in data}
    assert by_id["tiny-a"]["status"] == "loaded" and by_id["tiny-a"]["pinned"] is True
    assert by_id["tiny-a"]["memory_bytes"] > 0
    assert [m["kind"] for m in data] == ["chat", "chat", "chat", "vision"]
    assert all(m["context_length"] == CTX for m in data)
    if by_id["tiny-b"]["status"] == "unloaded":  # first in this module to use it
        assert "memory_bytes" not in by_id["tiny-b"]
    r = chat(many, "tiny-b", AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny-b" and r.json()["usage"]["completion_tokens"] == 3
    assert statuses(many, AUTH)["tiny-b"] == "loaded"


@pytest.mark.demo  # the shared server serves the demo model
def test_a_vision_model_and_a_text_model_side_by_side(many):
    message = {
        "role": "user",
        "content": [image_part(data_url(png(28, 28))), {"type": "text", "text": "What?"}],
    }
    body = {"messages": [message], "max_tokens": 2, "ignore_eos": True}
    url = many.base_url + "/v1/chat/completions"
    r = httpx.post(url, json={**body, "model": "tiny-vlm"}, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    r = httpx.post(url, json={**body, "model": "tiny-a"}, headers=AUTH, timeout=300)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[0].content[0]"
    assert "tiny-a" in r.json()["error"]["message"]


@pytest.mark.demo  # the shared server serves the demo model
def test_each_model_by_id_on_every_api_interleaved_and_concurrent(many):
    demo = demo_model_dir(float32=False).name
    oai = openai.OpenAI(
        base_url=many.base_url + "/v1", api_key=KEY, _strict_response_validation=True
    )
    ant = anthropic.Anthropic(base_url=many.base_url, api_key=KEY, _strict_response_validation=True)
    extra = {"ignore_eos": True}

    def via_chat(model: str) -> str:
        r = oai.chat.completions.create(
            model=model, messages=CHAT["messages"], max_tokens=3, extra_body=extra
        )
        assert r.usage is not None and r.usage.completion_tokens == 3
        return r.model

    def via_messages(model: str) -> str:
        r = ant.messages.create(
            model=model, max_tokens=3, messages=CHAT["messages"], extra_body=extra
        )
        assert r.usage.output_tokens == 3
        return r.model

    def via_responses(model: str) -> str:
        r = oai.responses.create(model=model, input="Hi", max_output_tokens=3, extra_body=extra)
        assert r.usage is not None and r.usage.output_tokens == 3
        return r.model

    def via_completions(model: str) -> str:
        r = oai.completions.create(model=model, prompt="Hi", max_tokens=3, extra_body=extra)
        return r.model

    calls = [
        (f, m)
        for m in (demo, "tiny-a", "tiny-b")
        for f in (via_chat, via_messages, via_responses, via_completions)
    ]
    for f, m in calls[::3]:  # interleaved, one after the other
        assert f(m) == m
    with ThreadPoolExecutor(len(calls)) as pool:  # all at once
        assert list(pool.map(lambda c: c[0](c[1]), calls)) == [m for _, m in calls]
    assert set(statuses(many, AUTH).values()) == {"loaded"}


def test_unknown_model_is_404_on_every_api(many):
    url = many.base_url
    for path, body in [
        ("/v1/chat/completions", {**CHAT, "model": "nope"}),
        ("/v1/completions", {"model": "nope", "prompt": "Hi"}),
        ("/v1/responses", {"model": "nope", "input": "Hi"}),
        ("/v1/chat/completions/count_tokens", {**CHAT, "model": "nope"}),
        ("/v1/models/load", {"model": "nope"}),
        ("/v1/models/unload", {"model": "nope"}),
    ]:
        r = httpx.post(url + path, json=body, headers=AUTH)
        assert r.status_code == 404, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert "tiny-a" in err["message"] and "tiny-b" in err["message"]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = {"model": "nope", "max_tokens": 3, "messages": CHAT["messages"]}
        r = httpx.post(url + path, json=body, headers={"x-api-key": KEY})
        assert r.status_code == 404, (path, r.text)
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
        assert "tiny-a" in body["error"]["message"]


@pytest.mark.demo  # the shared server serves the demo model
def test_load_and_unload_need_the_key_and_pins_stay(many):
    url = many.base_url
    for path in ("/v1/models/load", "/v1/models/unload"):
        assert httpx.post(url + path, json={"model": "tiny-b"}).status_code == 401
    r = httpx.post(url + "/v1/models/load", json={"model": "tiny-b"}, headers=AUTH)
    assert r.json() == {"model": "tiny-b", "status": "loaded"}
    r = httpx.post(url + "/v1/models/unload", json={"model": "tiny-b"}, headers=AUTH)
    assert r.json() == {"model": "tiny-b", "status": "unloaded"}
    assert statuses(many, AUTH)["tiny-b"] == "unloaded"
    r = httpx.post(url + "/v1/models/unload", json={"model": "tiny-a"}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert statuses(many, AUTH)["tiny-a"] == "loaded"
    r = httpx.post(url + "/v1/models/load", json={"model": "tiny-b"}, headers=AUTH)
    assert r.json()["status"] == "loaded"


@pytest.mark.demo  # the shared server serves the demo model
def test_keep_alive_zero_unloads_after_the_request(many):
    r = chat(many, "tiny-b", AUTH, keep_alive=0)
    assert r.status_code == 200, r.text
    until(lambda: statuses(many, AUTH)["tiny-b"] == "unloaded")
    r = chat(many, "tiny-b", AUTH, keep_alive="soon")
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"


@pytest.mark.demo  # the shared server serves the demo model
def test_health_and_metrics_per_model(many):
    chat(many, "tiny-a", AUTH)
    health = httpx.get(many.base_url + "/health").json()
    assert health["status"] == "ok" and health["models"]["tiny-a"]["status"] == "loaded"
    tiny_a = health["models"]["tiny-a"]  # --prompt-cache-dir '': no disk tier, and why
    assert tiny_a["prompt_cache_disk"] == "off"
    assert "--prompt-cache-dir" in tiny_a["prompt_cache_disk_off_reason"]
    metrics = httpx.get(many.base_url + "/metrics", headers=AUTH).text
    assert 'mlx_server_model_loaded{model="tiny-a"} 1.0' in metrics
    assert 'mlx_server_model_loads_total{model="tiny-a"} 1.0' in metrics  # pinned: once


def test_lru_unload_under_a_small_memory_budget(tiny_dir):
    # Each tiny model counts about 11 MB (a 10 MB KV budget, which holds its prefix cache,
    # and its weights): two fit in 0.025 GB, three do not.
    srv = start(["--models-dir", str(tiny_dir), "--models-memory-gb", "0.025"])
    try:
        for model in ("tiny-a", "tiny-b", "tiny-a"):  # tiny-b is the least recently used
            assert chat(srv, model).status_code == 200
        assert statuses(srv) == {"tiny-a": "loaded", "tiny-b": "loaded", "tiny-c": "unloaded"}
        assert chat(srv, "tiny-c").status_code == 200
        assert statuses(srv) == {"tiny-a": "loaded", "tiny-b": "unloaded", "tiny-c": "loaded"}
        srv.wait_for_line("Unloading model tiny-b (least recently used)")
    finally:
        srv.stop()


def test_idle_unload_and_keep_alive_forever(tiny_dir):
    args = ["-m", str(tiny_dir / "tiny-a"), "-m", str(tiny_dir / "tiny-b")]
    srv = start([*args, "--idle-unload-s", "1"])
    try:
        assert chat(srv, "tiny-a", keep_alive=-1).status_code == 200
        assert chat(srv, "tiny-b").status_code == 200
        until(lambda: statuses(srv)["tiny-b"] == "unloaded")
        assert statuses(srv)["tiny-a"] == "loaded"
        srv.wait_for_line("Unloading model tiny-b (idle)")
    finally:
        srv.stop()


@pytest.mark.demo  # the shared server serves the demo model
def test_tokenize_follows_the_named_model(many):
    demo = demo_model_dir(float32=False).name
    text = "Hello world, the quick brown fox"

    def tokens(model: str) -> list[int]:
        r = httpx.post(
            many.base_url + "/tokenize", json={"content": text, "model": model}, headers=AUTH
        )
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    # SmolLM2's 49k-token vocabulary against the tiny model's 400 tokens.
    assert tokens(demo) != tokens("tiny-a")
    assert tokens("tiny-a") == tokens("tiny-b")  # the tiny models share their tokenizer


@pytest.mark.demo  # the shared server serves the demo model
def test_ollama_routes_follow_the_registry(many):
    """/api/tags lists every offered model, /api/ps the loaded ones with their keep_alive,
    /api/show the named one; a chat with keep_alive 0 and no messages unloads it."""
    from ollama_support import CHAT_CHUNK, ERROR, PS, SHOW, TAGS

    def api(path: str, body: dict | None = None) -> httpx.Response:
        if body is None:
            return httpx.get(many.base_url + path, headers=AUTH, timeout=120)
        return httpx.post(many.base_url + path, json=body, headers=AUTH, timeout=120)

    tags = api("/api/tags").json()
    TAGS.validate(tags)
    demo = demo_model_dir(float32=False).name
    assert [m["name"] for m in tags["models"]] == [demo, "tiny-a", "tiny-b", "tiny-vlm"]
    say = {"messages": [{"role": "user", "content": "Hi"}], "options": {"num_predict": 2}}
    r = api("/api/chat", {"model": "tiny-b", **say, "stream": False, "keep_alive": "10m"})
    CHAT_CHUNK.validate(r.json())
    ps = api("/api/ps").json()
    PS.validate(ps)
    loaded = {m["name"]: m for m in ps["models"]}
    assert "tiny-b" in loaded and "tiny-a" in loaded
    assert loaded["tiny-b"]["expires_at"] < loaded["tiny-a"]["expires_at"]  # pinned: never
    show = api("/api/show", {"model": "tiny-b"}).json()
    SHOW.validate(show)
    assert show["details"]["family"] == "llama"
    missing = api("/api/show", {"model": "nope"})
    assert missing.status_code == 404
    ERROR.validate(missing.json())
    r = api("/api/chat", {"model": "tiny-b", "messages": [], "keep_alive": 0})
    assert r.json()["done_reason"] == "unload"
    until(lambda: statuses(many, AUTH)["tiny-b"] == "unloaded")
    # the context it is served with, loaded or not (unloaded: its config's was reported)
    assert api("/api/show", {"model": "tiny-b"}).json()["parameters"] == show["parameters"]
    assert show["parameters"] == f"num_ctx {loaded['tiny-b']['context_length']}"


@pytest.mark.demo  # the shared server serves the demo model
def test_ollama_images_on_a_vision_model(many):
    import base64

    image = base64.b64encode(png(32, 32)).decode()
    message = {"role": "user", "content": "What is this?", "images": [image]}
    body = {"messages": [message], "options": {"num_predict": 2}, "stream": False}
    r = httpx.post(
        many.base_url + "/api/chat", json={"model": "tiny-vlm", **body}, headers=AUTH, timeout=120
    )
    assert r.status_code == 200, r.text
    text_only = {"model": "tiny-vlm", **body, "messages": [{**message, "images": []}]}
    plain = httpx.post(many.base_url + "/api/chat", json=text_only, headers=AUTH, timeout=120)
    assert r.json()["prompt_eval_count"] > plain.json()["prompt_eval_count"]  # image tokens
    r = httpx.post(
        many.base_url + "/api/chat", json={"model": "tiny-b", **body}, headers=AUTH, timeout=120
    )
    assert r.status_code == 400 and "text only" in r.json()["error"]
