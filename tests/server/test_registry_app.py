"""A server of several models over scripted engines, in process: each request leases the
model its body names and runs on that model's own service; the lease lasts until the
response has ended (a stream's last byte), and an unknown model is each protocol's 404."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import httpx
import pytest
from clients import wait_until
from scripted_engine import ScriptedEngine
from support import serve_in_process

from mlx_server.boot.app import create_app
from mlx_server.registry.catalog import Offer
from mlx_server.registry.lease import RegistryModels
from mlx_server.registry.registry import Limits, ModelRegistry
from mlx_server.registry.routes import make_router
from mlx_server.service import ChatService

HI = [{"role": "user", "content": "Hi"}]


class _Weightless:
    def parameters(self) -> dict:
        return {}


@dataclass
class Parts:
    service: ChatService
    engine: ScriptedEngine
    loaded: object


@dataclass
class Several:
    url: str
    registry: ModelRegistry
    engines: dict[str, ScriptedEngine]

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=30)

    def answer(self, path: str, body: dict) -> dict:
        r = self.post(path, body)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def several(tiny_tokenizer):
    engines: dict[str, ScriptedEngine] = {}

    def load(offer: Offer) -> Parts:
        engines[offer.id] = engine = ScriptedEngine()
        service = ChatService(offer.id, tiny_tokenizer, engine, ctx_size=256)
        return Parts(service, engine, type("Loaded", (), {"model": _Weightless()})())

    offers = [Offer("a", "/m/a", "chat", 0), Offer("b", "/m/b", "chat", 0)]
    registry = ModelRegistry(offers, Limits(1 << 40, 0, 0.0, 4, 0), load)
    app = create_app(RegistryModels(registry, 256), extra=make_router(registry))
    srv = serve_in_process(app)
    yield Several(srv.base_url, registry, engines)
    srv.stop()


def test_each_request_runs_on_the_model_it_names(several):
    for model in ("b", "a", "b"):
        r = several.post("/v1/chat/completions", {"model": model, "messages": HI})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
    r = several.post("/v1/messages", {"model": "a", "max_tokens": 5, "messages": HI})
    assert r.status_code == 200 and r.json()["model"] == "a"
    r = several.post("/api/chat", {"model": "b", "messages": HI, "stream": False})
    assert r.status_code == 200 and r.json()["model"] == "b"
    assert [len(several.engines[m].requests) for m in "ab"] == [2, 3]
    r = several.post("/tokenize", {"model": "a", "content": "Hi"})
    assert r.status_code == 200 and r.json()["tokens"]
    listing = httpx.get(several.url + "/v1/models").json()["data"]
    assert {m["id"]: m["status"] for m in listing} == {"a": "loaded", "b": "loaded"}
    assert {m["name"] for m in httpx.get(several.url + "/api/ps").json()["models"]} == {"a", "b"}
    assert all(s.leases == 0 for s in several.registry.slots.values())


def test_unknown_model_is_each_protocols_404(several):
    r = several.post("/v1/chat/completions", {"model": "nope", "messages": HI})
    assert r.status_code == 404
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("model_not_found", "model")
    r = several.post("/v1/messages", {"model": "nope", "max_tokens": 5, "messages": HI})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = several.post("/api/chat", {"model": "nope", "messages": HI})
    assert r.status_code == 404 and "nope" in r.json()["error"]
    r = several.post("/v1/embeddings", {"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = several.post("/v1/embeddings", {"model": "a", "input": "x"})  # a chat model
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"


def test_a_stream_holds_its_model_until_its_last_byte(several):
    assert several.post("/v1/models/load", {"model": "b"}).json()["status"] == "loaded"
    gate = threading.Event()
    several.engines["b"].push("Hello", " there", gate=gate)
    body = {"model": "b", "messages": HI, "stream": True}
    slot = several.registry.slot("b")
    with httpx.stream("POST", several.url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the role chunk: the stream has begun
        assert slot.leases == 1
        # Unloading a model a stream uses waits for the stream to end.
        assert several.post("/v1/models/unload", {"model": "b"}).json()["status"] == "loaded"
        # /v1/cancel reaches every loaded model's engine.
        assert several.answer("/v1/cancel", {})["cancelled_count"] == 1
        gate.set()
        rest = list(lines)
    assert "data: [DONE]" in rest
    wait_until(lambda: slot.state == "unloaded", "the model to unload once its stream ended")
    assert slot.leases == 0


def test_a_refused_request_gives_its_lease_back(several):
    r = several.post("/v1/chat/completions", {"model": "a", "messages": HI, "n": 99})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = several.post("/v1/chat/completions", {"model": "a", "messages": HI, "keep_alive": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"
    assert several.registry.slot("a").leases == 0
    r = several.post("/v1/chat/completions", {"model": "a", "messages": HI, "keep_alive": 0})
    assert r.status_code == 200
    wait_until(lambda: several.registry.slot("a").state == "unloaded", "keep_alive 0 to unload")
