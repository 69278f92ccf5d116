"""End-to-end: ``/v1/rerank`` on the other reranker architectures, each a tiny random-weight
model of real shape in a real server process, checked against sentence-transformers'
``CrossEncoder`` on the same saved model: an XLM-RoBERTa cross-encoder (bge-reranker-base's
``XLMRobertaForSequenceClassification``) and a Qwen3-Reranker-style causal LM (a chat
template's prompt, scored by the "yes" and "no" logits of its last token)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from embedding_support import RERANK_DOCS as DOCS
from embedding_support import RERANK_QUERY as QUERY
from embedding_support import build_tiny_qwen3_reranker, build_tiny_xlmr_cross_encoder
from support import serving

pytestmark = pytest.mark.tiny

INSTRUCTION = "Find the passages a cat owner asks for"
BUILDERS = {"xlmr": build_tiny_xlmr_cross_encoder, "qwen3": build_tiny_qwen3_reranker}
# The longest input each model takes here: a short document fits, "long " * 300 does not.
CTX = {"xlmr": 128, "qwen3": 300}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def reranker(request, tmp_path_factory):
    name = request.param
    model = BUILDERS[name](tmp_path_factory.mktemp("rerank") / f"tiny-{name}")
    with serving(["--model", str(model), "--ctx-size", str(CTX[name])]) as sp:
        yield name, model, sp


def post(server, body) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/rerank", json=body, timeout=120)


def by_index(results: list[dict]) -> np.ndarray:
    scores = np.zeros(len(results))
    for x in results:
        scores[x["index"]] = x["relevance_score"]
    return scores


def cross_encoder(model, **kw):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(model), device="cpu", **kw)


def test_scores_match_cross_encoder_best_first(reranker):
    name, model, server = reranker
    expected = cross_encoder(model).predict([(QUERY, d) for d in DOCS])
    r = post(server, {"model": "r", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    assert np.allclose(by_index(results), expected, atol=1e-5), (by_index(results), expected)
    assert [x["index"] for x in results] == list(np.argsort(-expected))
    assert len(set(np.round(expected, 4))) == len(DOCS)  # the order is not a tie's


def test_an_instruction_is_sentence_transformers_prompt(reranker):
    name, model, server = reranker
    pairs = [(QUERY, d) for d in DOCS]
    expected = cross_encoder(model).predict(pairs, prompt=INSTRUCTION)
    r = post(server, {"query": QUERY, "documents": DOCS, "instruction": INSTRUCTION})
    assert r.status_code == 200, r.text
    ours = by_index(r.json()["results"])
    assert np.allclose(ours, expected, atol=1e-5), (ours, expected)
    plain = by_index(post(server, {"query": QUERY, "documents": DOCS}).json()["results"])
    assert not np.allclose(ours, plain, atol=1e-4)  # the instruction reached the model


def test_a_long_document_is_cut_as_sentence_transformers_cuts_it(reranker):
    name, model, server = reranker
    docs = ["long " * 300, DOCS[0]]
    r = post(server, {"query": QUERY, "documents": docs})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "documents"
    r = post(server, {"query": QUERY, "documents": docs, "truncate": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] <= 2 * CTX[name]
    # The causal reranker's cut keeps the template's tail (the prompt still ends where
    # the model answers), as sentence-transformers restores it.
    expected = cross_encoder(model, max_length=CTX[name]).predict([(QUERY, d) for d in docs])
    assert np.allclose(by_index(r.json()["results"]), expected, atol=1e-5)


def test_concurrent_reranks_match_one_by_one(reranker):
    from concurrent.futures import ThreadPoolExecutor

    _, _, server = reranker
    bodies = [{"query": f"{QUERY} {i}", "documents": DOCS[: 1 + i % 5]} for i in range(8)]
    alone = [by_index(post(server, b).json()["results"]) for b in bodies]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda b: by_index(post(server, b).json()["results"]), bodies))
    for a, b in zip(alone, together, strict=True):
        assert a.shape == b.shape and np.allclose(a, b, atol=1e-5)


def test_a_reranker_refuses_embeddings(reranker):
    _, _, server = reranker
    r = httpx.post(server.base_url + "/v1/embeddings", json={"input": "x"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
