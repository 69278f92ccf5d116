"""/v1/completions through the real server stack, driven by a scripted engine."""

from __future__ import annotations

import copy
import json

import httpx
import jsonschema
import openai
import pytest
from clients import openai_client, wait_until
from scripted_engine import Script
from support import schema_validator, start_in_process
from tiny_model import FIM_SPECIALS, build_tiny_model

RESPONSE = schema_validator("CreateCompletionResponse")
ERROR = schema_validator("ErrorResponse")


def _stream_chunk_validator() -> jsonschema.Draft202012Validator:
    """The response schema with ``finish_reason`` also null: OpenAI's stream chunks (its own
    documented example, llama.cpp, vLLM) carry null until a choice ends, although the
    schema, shared by both shapes, lists only the final values."""
    root = copy.deepcopy(RESPONSE.schema)
    resp = root["components"]["schemas"]["CreateCompletionResponse"]
    fr = resp["properties"]["choices"]["items"]["properties"]["finish_reason"]
    fr["type"] = [fr["type"], "null"]
    fr["enum"] = [*fr["enum"], None]
    return jsonschema.Draft202012Validator(root)


CHUNK = _stream_chunk_validator()


def post(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/completions", json=body, timeout=30)


def stream_chunks(srv, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(x[6:]) for x in lines[:-1]]


@pytest.fixture(scope="module")
def fim_tokenizer(tmp_path_factory):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    path = build_tiny_model(tmp_path_factory.mktemp("fim") / "tiny-fim", specials=FIM_SPECIALS)
    return load_tokenizer(path)


@pytest.fixture
def fim_server(fim_tokenizer):
    srv = start_in_process(fim_tokenizer)
    yield srv
    srv.stop()


def test_sdk_non_stream_is_valid(scripted, tiny_tokenizer):
    scripted.engine.push("Hello", " world")
    r = openai_client(scripted).completions.create(model="any", prompt="Once upon a time")
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.model == "any"
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [(0, "Hello world", "stop")]
    req = scripted.engine.requests[-1]
    # No chat template: the prompt is the text's own tokens; max_tokens defaults to 16.
    assert req.prompt_tokens == tiny_tokenizer.encode("Once upon a time")
    assert req.max_tokens == 16
    assert r.usage.prompt_tokens == len(req.prompt_tokens) and r.usage.completion_tokens == 2
    RESPONSE.validate(r.model_dump(exclude_unset=True))


def test_sdk_stream_and_chunks_are_valid(scripted):
    scripted.engine.push("A", "B", "C")
    pieces = [
        c.choices[0].text
        for c in openai.OpenAI(base_url=scripted.base_url + "/v1", api_key="x").completions.create(
            model="m", prompt="x", stream=True
        )
        if c.choices
    ]
    assert "".join(pieces) == "ABC"
    scripted.engine.push("A", "B", "C")
    chunks = stream_chunks(
        scripted,
        {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
    )
    for c in chunks:
        CHUNK.validate(c)
        assert c["object"] == "text_completion"
    *body, usage = chunks
    assert "".join(c["choices"][0]["text"] for c in body) == "ABC"
    assert [c["choices"][0]["finish_reason"] for c in body] == [None, None, None, "stop"]
    RESPONSE.validate(body[-1])  # the final chunk passes the schema as it is
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert "usage" not in body[-1]  # with include_usage, the usage chunk alone carries it


def test_batch_of_prompts_gives_one_choice_each(scripted, tiny_tokenizer):
    scripted.engine.push("one")
    scripted.engine.push("two")
    r = post(scripted, {"prompt": ["first prompt", "second"], "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    RESPONSE.validate(r.json())
    choices = r.json()["choices"]
    assert [(c["index"], c["text"]) for c in choices] == [(0, "one"), (1, "two")]
    a, b = scripted.engine.requests[-2:]
    assert a.request_id == b.request_id == r.json()["id"]
    assert a.prompt_tokens == tiny_tokenizer.encode("first prompt")
    assert b.prompt_tokens == tiny_tokenizer.encode("second")
    assert a.sampling.temperature == 0 and a.max_tokens == 5
    u = r.json()["usage"]
    assert u["prompt_tokens"] == len(a.prompt_tokens) + len(b.prompt_tokens)
    assert u["completion_tokens"] == 2


def test_batch_stream_interleaves_choices(scripted):
    scripted.engine.push("a1", "a2", delay=0.01)
    scripted.engine.push("b1", "b2", delay=0.01)
    chunks = stream_chunks(scripted, {"prompt": ["p", "q"], "stream": True})
    texts: dict[int, str] = {0: "", 1: ""}
    finishes = {}
    for c in chunks:
        CHUNK.validate(c)
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "a1a2", 1: "b1b2"} and finishes == {0: "stop", 1: "stop"}
    assert chunks[-1]["usage"]["completion_tokens"] == 4  # the last chunk carries the total


def test_token_id_prompts(scripted, tiny_tokenizer):
    ids = tiny_tokenizer.encode("Hello world")
    scripted.engine.push("x")
    r = post(scripted, {"prompt": ids, "echo": True})
    assert r.status_code == 200, r.text
    assert scripted.engine.requests[-1].prompt_tokens == ids
    assert r.json()["choices"][0]["text"] == "Hello worldx"
    scripted.engine.push("y")
    scripted.engine.push("z")
    r = post(scripted, {"prompt": [ids, ids[:2]]})
    assert [c["text"] for c in r.json()["choices"]] == ["y", "z"]
    assert [q.prompt_tokens for q in scripted.engine.requests[-2:]] == [ids, ids[:2]]


def test_echo_stream_sends_the_prompt_first(scripted):
    scripted.engine.push("!")
    chunks = stream_chunks(scripted, {"prompt": "Hi", "echo": True, "stream": True})
    assert chunks[0]["choices"][0]["text"] == "Hi"
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hi!"


def test_stop_seed_and_sampling_reach_the_engine(scripted):
    scripted.engine.push("abc", "STOP", "def")
    r = post(scripted, {"prompt": "x", "stop": "STOP", "seed": 7, "top_k": 3, "max_tokens": 9})
    assert r.json()["choices"][0]["text"] == "abc"
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    req = scripted.engine.requests[-1]
    assert req.stop == ("STOP",) and req.sampling.seed == 7 and req.sampling.top_k == 3


def test_max_tokens_length_finish(scripted):
    scripted.engine.push("a", "b", "c")
    r = post(scripted, {"prompt": "x", "max_tokens": 2})
    assert r.json()["choices"][0] == {
        "text": "ab",
        "index": 0,
        "logprobs": None,
        "finish_reason": "length",
    }


def test_max_tokens_zero_echoes_without_generating(scripted):
    before = len(scripted.engine.requests)
    r = post(scripted, {"prompt": "Just this", "max_tokens": 0, "echo": True})
    assert r.status_code == 200
    RESPONSE.validate(r.json())
    assert r.json()["choices"][0]["text"] == "Just this"
    assert r.json()["usage"]["completion_tokens"] == 0
    body = {"prompt": "Just", "max_tokens": 0, "echo": True, "stream": True}
    chunks = stream_chunks(scripted, {**body, "stream_options": {"include_usage": True}})
    for c in chunks:
        RESPONSE.validate(c)
    assert chunks[0]["choices"][0]["text"] == "Just" and "usage" not in chunks[0]
    assert chunks[1]["choices"] == [] and chunks[1]["usage"]["completion_tokens"] == 0
    assert len(scripted.engine.requests) == before


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"prompt": "x", "n": 17}, "n"),  # above --max-n
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": [10**9]}, "prompt[0]"),
        ({"prompt": [-1]}, "prompt[0]"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10_000}, "context size"),
        ({"prompt": "x", "seed": 1 << 64}, "seed"),
        ({"prompt": "x", "top_k": 100_000}, "top_k"),
    ],
)
def test_bad_requests_are_400(scripted, body, needle):
    r = post(scripted, body)
    assert r.status_code == 400, r.text
    ERROR.validate(r.json())
    assert needle in r.json()["error"]["message"], r.json()


def test_context_exceeded_has_its_code(scripted):
    r = post(scripted, {"prompt": "x", "max_tokens": 600})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_suffix_without_fim_tokens_is_400_naming_them(scripted):
    r = post(scripted, {"prompt": "def f(", "suffix": "\n    return x\n"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "suffix"
    for name in ("<|fim_prefix|>", "<fim_prefix>", "<PRE>", "<|fim▁begin|>"):
        assert name in err["message"]


def test_fim_prompt_is_prefix_suffix_middle(fim_server, fim_tokenizer):
    vocab = fim_tokenizer.get_vocab()
    pre, suf, mid = (vocab[t] for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))
    fim_server.engine.push("a + b")
    r = openai_client(fim_server).completions.create(
        model="m", prompt="def add(a, b):\n    return ", suffix="\n", max_tokens=8, stop=["\n\n"]
    )
    assert r.choices[0].text == "a + b"
    enc = lambda s: fim_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert fim_server.engine.requests[-1].prompt_tokens == [
        pre,
        *enc("def add(a, b):\n    return "),
        suf,
        *enc("\n"),
        mid,
    ]
    # The model's FIM end tokens stop it, besides the request's own stops.
    assert fim_server.engine.requests[-1].stop == ("\n\n", "<|fim_pad|>", "<|file_sep|>")
    # Token-id prefixes work too, and each prompt of a batch gets the suffix.
    fim_server.engine.push("1")
    fim_server.engine.push("2")
    r = post(fim_server, {"prompt": [enc("x = "), enc("y = ")], "suffix": ";"})
    assert [c["text"] for c in r.json()["choices"]] == ["1", "2"]
    first, second = fim_server.engine.requests[-2:]
    assert first.prompt_tokens == [pre, *enc("x = "), suf, *enc(";"), mid]
    assert second.prompt_tokens == [pre, *enc("y = "), suf, *enc(";"), mid]


def test_queue_full_is_503_and_cancels_the_rest_of_the_batch(scripted_factory):
    srv = scripted_factory()
    srv.engine.max_queue = 2
    srv.engine.default = Script(["x"] * 1000, delay=0.05)  # 50 s unless cancelled
    r = post(srv, {"prompt": ["a", "b", "c"]})
    assert r.status_code == 503 and "Retry-After" in r.headers
    ERROR.validate(r.json())
    assert len(srv.engine.requests) == 2
    # The two prompts that were queued are cancelled, not left running.
    assert wait_until(lambda: httpx.get(srv.base_url + "/health").json()["active"] == 0)


def test_cancel_by_id_stops_every_choice(scripted):
    scripted.engine.push(*(["w"] * 400), delay=0.01)
    scripted.engine.push(*(["v"] * 400), delay=0.01)
    body = {"prompt": ["p", "q"], "stream": True, "max_tokens": 500}
    finishes: dict[int, str] = {}
    texts = {0: "", 1: ""}
    cancelled = None
    with httpx.stream("POST", scripted.base_url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if cancelled is None:
                c = httpx.post(scripted.base_url + "/v1/cancel", json={"id": chunk["id"]})
                cancelled = c.json()["cancelled_count"]
            for ch in chunk["choices"]:
                texts[ch["index"]] += ch["text"]
                if ch["finish_reason"]:
                    finishes[ch["index"]] = ch["finish_reason"]
    assert cancelled == 2
    assert finishes == {0: "stop", 1: "stop"}
    assert len(texts[0]) < 400 and len(texts[1]) < 400


def test_key_and_body_limits_apply(scripted_factory):
    srv = scripted_factory(api_key="k")
    r = post(srv, {"prompt": "x"})
    assert r.status_code == 401
    r = httpx.post(
        srv.base_url + "/v1/completions",
        json={"prompt": "a" * (11 * 1024 * 1024)},
        headers={"x-api-key": "k"},
    )
    assert r.status_code == 413
    ERROR.validate(r.json())
    assert srv.engine.requests == []


def test_client_leaving_a_stream_frees_its_slots(scripted):
    scripted.engine.push(*(["w"] * 1000), delay=0.02)
    scripted.engine.push(*(["v"] * 1000), delay=0.02)
    body = {"prompt": ["p", "q"], "stream": True, "max_tokens": 500}
    with httpx.stream("POST", scripted.base_url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # leave after the first chunk
    assert wait_until(lambda: httpx.get(scripted.base_url + "/health").json()["active"] == 0)


def test_generation_failure_is_500_or_an_error_event(scripted):
    scripted.engine.push("partial", finish="error")
    r = post(scripted, {"prompt": "x"})
    assert r.status_code == 500
    ERROR.validate(r.json())
    scripted.engine.push("partial", finish="error")
    body = {"prompt": "x", "stream": True}
    with httpx.stream("POST", scripted.base_url + "/v1/completions", json=body) as resp:
        lines = [x for x in resp.iter_lines() if x]
    assert lines[0].startswith("data: {") and "partial" in lines[0]
    assert any(x.startswith("error: ") for x in lines)
    assert "data: [DONE]" not in lines


def test_fim_prompt_keeps_the_tokenizers_bos():
    from mlx_server.models.text_prompt import fim_prompt, find_fim_tokens

    class BosTokenizer:  # a Llama-style tokenizer: BOS (1) first; CodeLlama's FIM spelling
        def get_vocab(self) -> dict[str, int]:
            return {"<s>": 1, "▁<PRE>": 5, "▁<SUF>": 6, "▁<MID>": 7, "a": 10, "b": 11}

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            ids = [10 if ch == "a" else 11 for ch in text]
            return [1, *ids] if add_special_tokens else ids

    tok = BosTokenizer()
    fim = find_fim_tokens(tok)
    assert fim is not None and fim.spelling == ("▁<PRE>", "▁<SUF>", "▁<MID>")
    assert fim_prompt(tok, fim, "ab", "b") == [1, 5, 10, 11, 6, 11, 7]
    assert fim_prompt(tok, fim, [10], "") == [5, 10, 6, 7]  # token ids: exactly as given
