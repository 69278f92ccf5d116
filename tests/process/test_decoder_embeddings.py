"""End-to-end: ``/v1/embeddings`` on a decoder embedder (Qwen3-Embedding's layout: last-token
pooling, Normalize, a ``query`` instruction prompt), a tiny random-weight Qwen3 in a real
server process, checked against sentence-transformers on the same saved model."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from embedding_support import QWEN3_QUERY_PROMPT, build_tiny_qwen3_embedder
from support import serving

pytestmark = pytest.mark.tiny

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world!",
    "def add(a, b): return a + b",
    "What is the capital of France? Paris is the capital. " * 4,
    "hi",
]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    return build_tiny_qwen3_embedder(tmp_path_factory.mktemp("embed") / "tiny-qwen3-embedding")


@pytest.fixture(scope="module")
def server(embedder):
    with serving(["--model", str(embedder), "--ctx-size", "4096"]) as sp:
        yield sp


@pytest.fixture(scope="module")
def reference(embedder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedder), device="cpu")


def embed(server, body) -> np.ndarray:
    r = httpx.post(server.base_url + "/v1/embeddings", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def assert_close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    cos = (ours * ref).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert cos.min() >= 0.9999, cos
    assert np.allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-5)


def test_vectors_match_sentence_transformers(server, reference):
    ours = embed(server, {"input": TEXTS})
    assert ours.shape == (len(TEXTS), 64)
    assert_close(ours, reference.encode(TEXTS))
    # Last-token pooling reads each input's own last token: batched with longer inputs
    # (right padding) or alone, the vector is the same.
    alone = np.concatenate([embed(server, {"input": [t]}) for t in TEXTS])
    assert np.allclose(alone, ours, atol=1e-5)


def test_the_query_prompt_is_sentence_transformers_prompt(server, reference):
    query = embed(server, {"input": TEXTS, "prompt_name": "query"})
    assert_close(query, reference.encode(TEXTS, prompt_name="query"))
    plain = embed(server, {"input": TEXTS})
    assert float((query * plain).sum(-1).max()) < 0.9999  # the instruction reached the model
    same = embed(server, {"input": TEXTS, "prompt": QWEN3_QUERY_PROMPT})
    assert np.allclose(same, query, atol=1e-5)
    document = embed(server, {"input": TEXTS, "prompt_name": "document"})  # the empty prompt
    assert np.allclose(document, plain, atol=1e-5)
    own = embed(server, {"input": TEXTS[:2], "prompt": "Instruct: find code\nQuery:"})
    assert_close(own, reference.encode(TEXTS[:2], prompt="Instruct: find code\nQuery:"))


def test_token_ids_are_embedded_as_given(server, reference):
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    assert_close(embed(server, {"input": ids}), reference.encode(TEXTS[:3]))


def test_usage_counts_the_prompt(server, reference):
    body = {"input": TEXTS[:2], "prompt_name": "query"}
    r = httpx.post(server.base_url + "/v1/embeddings", json=body, timeout=60)
    n = sum(len(reference.tokenizer(QWEN3_QUERY_PROMPT + t)["input_ids"]) for t in TEXTS[:2])
    assert r.json()["usage"]["prompt_tokens"] == n


@pytest.mark.parametrize(
    ("body", "param", "word"),
    [
        ({"input": TEXTS, "prompt_name": "passage"}, "prompt_name", "'query'"),
        ({"input": [[1, 2, 3]], "prompt_name": "query"}, "prompt_name", "token ids"),
        ({"input": [[1, 2, 3]], "prompt": "x"}, "prompt", "token ids"),
        ({"input": TEXTS, "prompt": 5}, "prompt", "prompt"),
    ],
)
def test_bad_prompts_are_400s(server, body, param, word):
    r = httpx.post(server.base_url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and word in error["message"], error
