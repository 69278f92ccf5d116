"""Several models in one server process, embedding models among them: the embedding demo
model and a tiny reranker loaded on their first request next to a tiny chat model, each
route refusing a model of the other kind, and keep_alive 0 unloading the encoder."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from embedding_support import build_tiny_cross_encoder, embedding_demo_dir
from support import free_port, launch
from test_models_process import CHAT, SMALL, statuses, until
from tiny_model import build_tiny_model

pytestmark = pytest.mark.demo

TEXTS = ["The cat sits on the mat.", "Stock markets fell sharply on Monday.", "hi"]
EMBED = "all-minilm-l6-v2"  # the demo model, offered by its folder name


def start(args: list[str]):
    srv = launch([*args, "--port", str(free_port())])
    assert srv.wait_ready(150), srv.lines
    return srv


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A tiny chat model (the default), the embedding demo model and a tiny reranker."""
    root = tmp_path_factory.mktemp("mixed")
    build_tiny_model(root / "tiny-chat", seed=0)
    build_tiny_cross_encoder(root / "tiny-rerank")
    args = ["-m", str(root / "tiny-chat"), "-m", str(embedding_demo_dir())]
    srv = start([*SMALL, *args, "-m", str(root / "tiny-rerank")])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def single_vectors() -> np.ndarray:
    """The same texts' vectors from a server of the embedding model alone (Jan's launch)."""
    model = embedding_demo_dir() / "model.safetensors"
    srv = start(["--model", str(model), "--ctx-size", "4096", "--embedding"])
    try:
        return vectors(post(srv, "/v1/embeddings", {"input": TEXTS}))
    finally:
        srv.stop()


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=120)


def vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)


def refused(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_embedding_model_loads_on_first_request_and_embeds_as_alone(mixed, single_vectors):
    assert set(statuses(mixed).values()) == {"unloaded"}  # nothing pinned: none loaded yet
    listed = {m["id"]: m for m in httpx.get(mixed.base_url + "/v1/models").json()["data"]}
    assert (listed[EMBED]["kind"], listed["tiny-rerank"]["kind"]) == ("embedding", "embedding")

    got = vectors(post(mixed, "/v1/embeddings", {"model": EMBED, "input": TEXTS}))
    np.testing.assert_allclose(got, single_vectors, atol=1e-5)
    entry = {m["id"]: m for m in httpx.get(mixed.base_url + "/v1/models").json()["data"]}[EMBED]
    assert (entry["status"], entry["capabilities"]) == ("loaded", ["embeddings"])
    assert entry["memory_bytes"] > 0

    client = openai.OpenAI(
        base_url=mixed.base_url + "/v1", api_key="x", _strict_response_validation=True
    )
    result = client.embeddings.create(model=EMBED, input=TEXTS[0], encoding_format="float")
    assert result.model == EMBED
    np.testing.assert_allclose(result.data[0].embedding, single_vectors[0], atol=1e-5)


def test_chat_and_rerank_by_id(mixed):
    r = post(mixed, "/v1/chat/completions", {"model": "tiny-chat", **CHAT})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny-chat"
    body = {"model": "tiny-rerank", "query": "cats", "documents": ["a cat", "stocks", "a dog"]}
    r = post(mixed, "/v1/rerank", body)
    assert r.status_code == 200, r.text
    assert sorted(x["index"] for x in r.json()["results"]) == [0, 1, 2]
    assert statuses(mixed)["tiny-rerank"] == "loaded"


def test_each_route_refuses_the_other_kind_and_unknown_ids(mixed):
    for model in (EMBED, "tiny-rerank"):
        error = refused(post(mixed, "/v1/chat/completions", {"model": model, **CHAT}), 400)
        assert (error["param"], error["code"]) == ("model", "model_not_supported")
        assert "embedding model" in error["message"]
    for path, body in (
        ("/v1/embeddings", {"input": "hi"}),
        ("/v1/rerank", {"query": "q", "documents": ["d"]}),
    ):
        error = refused(post(mixed, path, {"model": "tiny-chat", **body}), 400)
        assert (error["param"], error["code"]) == ("model", "model_not_supported")
        assert "chat model" in error["message"]
        error = refused(post(mixed, path, {"model": "nope", **body}), 404)
        assert error["code"] == "model_not_found"
    # No model: the default (a chat model) does not embed, so the first embedder answers
    # embeddings and the first reranker (offered after the embedder) reranks.
    r = post(mixed, "/v1/embeddings", {"input": "hi"})
    assert r.status_code == 200 and r.json()["model"] == EMBED, r.text
    r = post(mixed, "/v1/rerank", {"query": "cats", "documents": ["a cat", "stocks"]})
    assert r.status_code == 200 and r.json()["model"] == "tiny-rerank", r.text
    assert len(r.json()["results"]) == 2
    # An embedding model asked to rerank (and a reranker to embed): the service's own 400.
    body = {"model": EMBED, "query": "q", "documents": ["d"]}
    assert refused(post(mixed, "/v1/rerank", body), 400)["param"] == "model"
    body = {"model": "tiny-rerank", "input": "hi"}
    assert refused(post(mixed, "/v1/embeddings", body), 400)["param"] == "model"
    r = post(mixed, "/v1/chat/completions", {"model": "tiny-chat", **CHAT})
    assert r.status_code == 200, r.text  # the refusals hurt nothing


def test_keep_alive_zero_unloads_the_embedding_model_and_it_reloads(mixed, single_vectors):
    body = {"model": EMBED, "input": TEXTS, "keep_alive": 0}
    np.testing.assert_allclose(
        vectors(post(mixed, "/v1/embeddings", body)), single_vectors, atol=1e-5
    )
    until(lambda: statuses(mixed)[EMBED] == "unloaded")
    assert statuses(mixed)["tiny-chat"] == "loaded"
    got = vectors(post(mixed, "/v1/embeddings", {"model": EMBED, "input": TEXTS}))
    np.testing.assert_allclose(got, single_vectors, atol=1e-5)
    assert statuses(mixed)[EMBED] == "loaded"


def test_ollama_embed_by_id(mixed, single_vectors):
    r = post(mixed, "/api/embed", {"model": EMBED, "input": TEXTS})
    assert r.status_code == 200, r.text
    got = np.array(r.json()["embeddings"], dtype=np.float32)
    np.testing.assert_allclose(got, single_vectors, atol=1e-5)
    r = post(mixed, "/api/embed", {"model": "tiny-chat", "input": "hi"})
    assert r.status_code == 400 and list(r.json()) == ["error"]
    assert "tiny-chat" in r.json()["error"]


def test_an_embedding_model_reports_its_own_longest_input(mixed):
    """Every route gives the limit the server enforces: the model's 256 tokens, not
    --ctx-size nor its config's 512 position embeddings."""
    vectors(post(mixed, "/v1/embeddings", {"model": EMBED, "input": ["a"]}))
    listed = httpx.get(mixed.base_url + "/v1/models", timeout=30).json()["data"]
    assert {m["id"]: m["context_length"] for m in listed}[EMBED] == 256
    ps = httpx.get(mixed.base_url + "/api/ps", timeout=30).json()["models"]
    assert {m["name"]: m["context_length"] for m in ps}[EMBED] == 256
    show = post(mixed, "/api/show", {"model": EMBED}).json()
    assert show["parameters"] == "num_ctx 256"
