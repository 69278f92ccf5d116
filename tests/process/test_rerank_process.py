"""End-to-end: ``/v1/rerank`` on a tiny random-weight BERT cross-encoder in a real server
process, checked against sentence-transformers' ``CrossEncoder`` on the same model; and the
embeddings routes refused by a chat model."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from embedding_support import RERANK_DOCS as DOCS
from embedding_support import RERANK_QUERY as QUERY
from embedding_support import build_tiny_cross_encoder
from support import serving
from tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return build_tiny_cross_encoder(tmp_path_factory.mktemp("rerank") / "tiny-reranker")


@pytest.fixture(scope="module")
def server(reranker):
    with serving(["--model", str(reranker), "--ctx-size", "512"]) as sp:
        yield sp


def post(server, body, path="/v1/rerank") -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def test_scores_match_cross_encoder_and_are_sorted(server, reranker):
    from sentence_transformers import CrossEncoder

    expected = CrossEncoder(str(reranker), device="cpu").predict([(QUERY, d) for d in DOCS])
    r = post(server, {"model": "r", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    results = body["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    ours = np.zeros(len(DOCS))
    for x in results:
        ours[x["index"]] = x["relevance_score"]
    assert np.allclose(ours, expected, atol=1e-5), (ours, expected)
    assert [x["index"] for x in results] == list(np.argsort(-expected))
    assert body["model"] == "r" and body["usage"]["prompt_tokens"] > 0


def test_top_n_documents_and_the_route_without_v1(server):
    full = post(server, {"query": QUERY, "documents": DOCS}).json()["results"]
    body = {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2}
    r = post(server, {**body, "return_documents": True}, path="/rerank")
    assert r.status_code == 200, r.text
    top = r.json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in full[:2]]
    assert [x["document"]["text"] for x in top] == [DOCS[x["index"]] for x in top]
    assert "document" not in full[0]


def test_concurrent_reranks_match_one_by_one(server):
    from concurrent.futures import ThreadPoolExecutor

    bodies = [{"query": f"{QUERY} {i}", "documents": DOCS[: 1 + i % 5]} for i in range(16)]
    alone = [post(server, b).json()["results"] for b in bodies]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda b: post(server, b).json()["results"], bodies))
    for a, b in zip(alone, together, strict=True):
        assert [x["index"] for x in a] == [x["index"] for x in b]
        assert np.allclose([x["relevance_score"] for x in a], [x["relevance_score"] for x in b])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"query": QUERY, "documents": []}, "documents"),
        ({"query": "", "documents": DOCS}, "query"),
        ({"query": QUERY, "documents": ["ok", ""]}, "documents"),
        ({"query": QUERY, "documents": ["long " * 300]}, "documents"),
        ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
        ({"documents": DOCS}, "query"),
    ],
)
def test_bad_rerank_requests_are_400s(server, body, param):
    r = post(server, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_truncate_lets_a_long_document_through(server):
    r = post(server, {"query": QUERY, "documents": ["long " * 300, DOCS[0]], "truncate": True})
    assert r.status_code == 200, r.text
    assert len(r.json()["results"]) == 2


def test_a_reranker_refuses_embeddings_and_chat(server):
    r = post(server, {"input": "x"}, path="/v1/embeddings")
    assert r.status_code == 400 and "rerank model" in r.json()["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert post(server, chat, path="/v1/chat/completions").status_code == 400


def test_a_chat_model_refuses_embeddings_and_rerank(tmp_path):
    model = build_tiny_model(tmp_path / "tiny-chat")
    with serving(["-m", str(model), "--ctx-size", "256"]) as sp:
        for path, body in (
            ("/v1/embeddings", {"input": "x"}),
            ("/embeddings", {"input": "x"}),
            ("/v1/rerank", {"query": "q", "documents": ["d"]}),
        ):
            r = post(sp, body, path=path)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "model" and "chat model" in error["message"]
