"""End-to-end: ``/v1/embeddings`` on the embedding demo model (all-MiniLM-L6-v2) in a real
server process started as Jan starts it, checked against sentence-transformers' own vectors."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from clients import openai_client
from embedding_support import embedding_demo_dir
from support import serving

pytestmark = pytest.mark.demo

KEY = "embed-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXTS = [
    "The cat sits on the mat.",
    "A feline rests on a rug",
    "Stock markets fell sharply on Monday.",
    "MLX is an array framework for machine learning on Apple silicon.",
    "hi",
    "Ünïcödé text, emoji 🙂 and punctuation?!",
]
LONG = "word " * 400  # over the model's 256-token maximum


@pytest.fixture(scope="module")
def server():
    """Jan's launch: the weights file inside the model folder, --ctx-size, --embedding and
    --api-key."""
    model = embedding_demo_dir() / "model.safetensors"
    with serving(
        ["--model", str(model), "--ctx-size", "4096", "--embedding", "--api-key", KEY]
    ) as sp:
        yield sp


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedding_demo_dir()), device="cpu")


def post(server, body, path="/v1/embeddings", headers=AUTH) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=120)


def vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return np.array([d["embedding"] for d in data], dtype=np.float32)


def assert_close(ours: np.ndarray, ref: np.ndarray) -> None:
    ref = ref / np.linalg.norm(ref, axis=-1, keepdims=True)
    cos = (ours * ref).sum(-1) / np.linalg.norm(ours, axis=-1)
    assert cos.min() >= 0.9999, cos
    assert np.allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-5)


def test_strings_match_sentence_transformers(server, reference):
    r = post(server, {"model": "m", "input": TEXTS})
    assert_close(vectors(r), reference.encode(TEXTS))
    body = r.json()
    assert body["object"] == "list" and body["model"] == "m"
    assert body["data"][0]["object"] == "embedding" and len(body["data"][0]["embedding"]) == 384


def test_one_string_and_the_route_without_v1(server, reference):
    ours = vectors(post(server, {"input": TEXTS[0]}, path="/embeddings"))
    assert ours.shape == (1, 384)
    assert_close(ours, reference.encode([TEXTS[0]]))


def test_token_ids_match_the_same_texts(server, reference):
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    assert_close(vectors(post(server, {"input": ids})), reference.encode(TEXTS[:3]))
    one = vectors(post(server, {"input": ids[0]}))  # a single list of token ids
    assert_close(one, reference.encode(TEXTS[:1]))


def test_usage_counts_the_tokens(server, reference):
    body = post(server, {"input": TEXTS}).json()
    n = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}


def test_base64_is_the_float_vector(server):
    floats = vectors(post(server, {"input": TEXTS[:2]}))
    body = post(server, {"input": TEXTS[:2], "encoding_format": "base64"}).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in body["data"]]
    assert np.array_equal(np.stack(decoded), floats)


def test_dimensions_cut_and_renormalise(server, reference):
    ours = vectors(post(server, {"input": TEXTS, "dimensions": 64}))
    assert ours.shape == (len(TEXTS), 64)
    assert_close(ours, reference.encode(TEXTS)[:, :64])


def test_truncate_cuts_where_sentence_transformers_does(server, reference):
    ours = vectors(post(server, {"input": [LONG], "truncate": True}))
    assert_close(ours, reference.encode([LONG]))  # it truncates at max_seq_length (256)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": ["ok", LONG]}, "input", ["input[1]", "tokens", "256"]),
        ({"input": ""}, "input", ["input[0]", "empty"]),
        ({"input": ["a", ""]}, "input", ["input[1]", "empty"]),
        ({"input": []}, "input", ["empty"]),
        ({"input": [[101, 102], []]}, "input", ["input[1]", "empty"]),
        ({"input": ["x"] * 2049}, "input", ["2049", "2048"]),
        ({"input": [101, 99999999]}, "input", ["99999999", "vocabulary"]),
        ({"input": ["a"], "dimensions": 385}, "dimensions", ["384"]),
        ({"input": ["a"], "dimensions": 0}, "dimensions", ["dimensions"]),
        ({"input": ["a"], "encoding_format": "int8"}, "encoding_format", ["encoding_format"]),
        ({"input": 5}, "input", ["input"]),
        ({"model": "m"}, "input", ["input"]),
    ],
)
def test_bad_requests_are_400s_naming_the_problem(server, body, param, words):
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    for word in words:
        assert word in error["message"], error


def test_chat_requests_to_an_embedding_model_are_400s(server):
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    r = post(server, chat, path="/v1/chat/completions")
    assert r.status_code == 400
    assert "embedding model" in r.json()["error"]["message"]
    r = post(server, {**chat, "max_tokens": 8}, path="/v1/messages")
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and "embedding model" in body["error"]["message"]
    r = post(server, {"query": "q", "documents": ["d"]}, path="/v1/rerank")
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "is an embedding model; it serves /v1/embeddings" in r.json()["error"]["message"]


def test_every_route_needs_the_key(server):
    for path in ("/v1/embeddings", "/embeddings"):
        assert post(server, {"input": "a"}, path=path, headers={}).status_code == 401
    r = httpx.get(server.base_url + "/v1/models", headers=AUTH, timeout=30)
    assert r.json()["data"][0]["capabilities"] == ["embeddings"]
    assert httpx.get(server.base_url + "/health", timeout=30).json()["status"] == "ok"


def test_sixteen_concurrent_clients_get_what_one_by_one_gets(server):
    bodies = [{"input": [f"{t} #{i}" for t in TEXTS[: 1 + i % len(TEXTS)]]} for i in range(16)]
    alone = [vectors(post(server, b)) for b in bodies]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda b: vectors(post(server, b)), bodies))
    for a, b in zip(alone, together, strict=True):
        assert a.shape == b.shape
        assert np.allclose(a, b, atol=1e-5)


def test_openai_sdk_strict(server, reference):
    result = openai_client(server, api_key=KEY, strict=True).embeddings.create(
        model="m", input=TEXTS, encoding_format="float"
    )
    ours = np.array([d.embedding for d in result.data], dtype=np.float32)
    assert_close(ours, reference.encode(TEXTS))
    assert result.usage.prompt_tokens == result.usage.total_tokens > 0
    one = openai_client(server, api_key=KEY, strict=True).embeddings.create(
        model="m", input="hello", dimensions=32, encoding_format="float"
    )
    assert len(one.data[0].embedding) == 32


def test_openai_sdk_decodes_our_base64(server, reference):
    # Without encoding_format the SDK asks for base64 and decodes it after validating the
    # raw body, whose strings a strict client's schema (lists of floats) cannot accept.
    result = openai_client(server, api_key=KEY, strict=False).embeddings.create(
        model="m", input=TEXTS
    )
    ours = np.array([d.embedding for d in result.data], dtype=np.float32)
    assert_close(ours, reference.encode(TEXTS))


def test_metrics_count_the_route(server):
    post(server, {"input": "counted"})
    text = httpx.get(server.base_url + "/metrics", headers=AUTH, timeout=30).text
    assert 'route="/v1/embeddings"' in text


def test_ollama_s_listing_routes_answer_on_an_embedding_server(server):
    """Ollama's clients check these before ``/api/embed``; they listed nothing (404) here."""
    get = lambda path: httpx.get(server.base_url + path, headers=AUTH, timeout=30)  # noqa: E731
    tags = get("/api/tags")
    assert tags.status_code == 200, tags.text
    (entry,) = tags.json()["models"]
    (loaded,) = get("/api/ps").json()["models"]
    assert loaded["name"] == entry["name"]
    assert get("/api/version").json()["version"]
    show = post(server, {"model": entry["name"]}, path="/api/show")
    assert show.status_code == 200, show.text
    assert "embedding" in show.json()["capabilities"]
