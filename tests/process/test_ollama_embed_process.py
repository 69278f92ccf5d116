"""Ollama's ``/api/embed`` and ``/api/embeddings`` on the embedding demo model
(all-MiniLM-L6-v2) in a real server process started with ``--embedding``: the official
client's ``embed``, vectors equal to the same server's ``/v1/embeddings``."""

from __future__ import annotations

import httpx
import numpy as np
import ollama
import pytest
from embedding_support import embedding_demo_dir
from ollama_support import EMBED, EMBEDDINGS, ERROR
from support import serving

pytestmark = pytest.mark.demo

TEXTS = ["The cat sits on the mat.", "Stock markets fell sharply on Monday.", "hi"]


@pytest.fixture(scope="module")
def server():
    model = embedding_demo_dir() / "model.safetensors"
    with serving(["--model", str(model), "--ctx-size", "4096", "--embedding"], timeout=300) as sp:
        yield sp


def v1_vectors(server, texts: list[str]) -> np.ndarray:
    r = httpx.post(server.base_url + "/v1/embeddings", json={"input": texts}, timeout=120)
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def test_embed_matches_v1_embeddings(server):
    body = {"model": "all-minilm", "input": TEXTS}
    r = httpx.post(server.base_url + "/api/embed", json=body, timeout=120)
    assert r.status_code == 200, r.text
    EMBED.validate(r.json())
    assert r.json()["prompt_eval_count"] > len(TEXTS)
    got = np.array(r.json()["embeddings"], dtype=np.float32)
    np.testing.assert_allclose(got, v1_vectors(server, TEXTS), atol=1e-5)

    one = ollama.Client(host=server.base_url).embed(model="all-minilm", input=TEXTS[0])
    np.testing.assert_allclose(np.array(one.embeddings[0]), got[0], atol=1e-5)


def test_the_older_embeddings_route(server):
    r = httpx.post(
        server.base_url + "/api/embeddings",
        json={"model": "all-minilm", "prompt": TEXTS[1]},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    EMBEDDINGS.validate(r.json())
    np.testing.assert_allclose(
        np.array(r.json()["embedding"]), v1_vectors(server, [TEXTS[1]])[0], atol=1e-5
    )
    vec = ollama.Client(host=server.base_url).embeddings(model="all-minilm", prompt=TEXTS[1])
    assert len(vec.embedding) == len(r.json()["embedding"])


def test_errors_in_ollamas_shape(server):
    r = httpx.post(server.base_url + "/api/embed", json={"model": "m"}, timeout=30)
    assert r.status_code == 400
    ERROR.validate(r.json())
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(server.base_url + "/api/chat", json=chat, timeout=30)
    assert r.status_code == 400 and "embedding model" in r.json()["error"]
