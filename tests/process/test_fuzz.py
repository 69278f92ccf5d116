"""Generated requests against the real server on the tiny model: valid, edge and malformed
shapes of both APIs' requests, plus arbitrary JSON and bytes on every POST route.

Every request gets an answer in time, never a 5xx; every 4xx comes in its protocol's own
envelope; every stream is well-formed JSON frames ending the protocol's way; and after each
batch of generated requests an ordinary request still succeeds."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import serving

from mlx_server.server.http import MAX_JSON_DEPTH

CHECK_EVERY = 40
TIMEOUT = 60.0

# Each test sends hundreds of generated requests: the longest took 82 s on a 2-core machine
# busy with other tests, so ten minutes is a hang, not a slow run.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    with (
        serving(["-m", str(tiny_model_dir), "--ctx-size", "512"]) as sp,
        httpx.Client(base_url=sp.base_url, timeout=TIMEOUT) as client,
    ):
        sp.client = client  # type: ignore[attr-defined]
        sp.sent = 0  # type: ignore[attr-defined]
        sp.statuses = Counter()  # type: ignore[attr-defined]
        yield sp


# ---- building blocks ---------------------------------------------------------------------

SURROGATE = "\ud800"  # encoded as the JSON escape "\\ud800" by ensure_ascii
texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "<think>", "</think>", "<tool_call>", "\x00", SURROGATE, "a" * 300]),
)
numbers = st.one_of(
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, 1, -1, 0.5, 2, 3, 1 << 64, (1 << 64) - 1, -(1 << 63), 1e308]),
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, texts),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def maybe(strategy: st.SearchStrategy, junk: bool = True) -> st.SearchStrategy:
    """Absent (None), the strategy's value, or (sometimes) any JSON value at all."""
    options = [st.none(), strategy, strategy]
    if junk:
        options.append(json_values)
    return st.one_of(*options)


small_ints = st.integers(min_value=-3, max_value=12)
schema_objects = st.sampled_from(
    [
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"type": "object"},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
        {"type": "object", "uniqueItems": True},
        {"type": "nonsense"},
        {"$ref": "#/$defs/missing"},
        {},
    ]
)
openai_tools = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function", "other"]),
            "function": st.fixed_dictionaries(
                {"name": maybe(st.sampled_from(["get_weather", "f", "", "bad name!"]))},
                optional={"parameters": schema_objects, "description": texts},
            ),
        }
    ),
    max_size=3,
)


def openai_messages() -> st.SearchStrategy:
    part = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": maybe(texts)}),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["image_url", "input_audio", "video_url", "weird"])},
            optional={"image_url": maybe(st.fixed_dictionaries({"url": texts}))},
        ),
    )
    call = st.fixed_dictionaries(
        {
            "id": maybe(texts),
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": maybe(texts, junk=False)},
                optional={"arguments": st.one_of(texts, st.just('{"a": 1}'), json_values)},
            ),
        }
    )
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "bot", ""])},
        optional={
            "content": st.one_of(st.none(), texts, st.lists(part, max_size=3), numbers),
            "tool_calls": st.lists(call, max_size=2),
            "tool_call_id": texts,
            "reasoning_content": texts,
            "name": texts,
        },
    )
    return st.lists(message, max_size=4)


OPENAI_WIDE = dict(
    messages=st.one_of(openai_messages(), json_values),
    **{
        "model": maybe(texts),
        "max_tokens": maybe(small_ints),
        "max_completion_tokens": maybe(small_ints),
        "temperature": maybe(st.floats(-1, 3, allow_nan=False)),
        "top_p": maybe(st.floats(-0.5, 1.5, allow_nan=False)),
        "top_k": maybe(st.one_of(small_ints, st.integers(0, 1 << 20))),
        "min_p": maybe(st.floats(-1, 2, allow_nan=False)),
        "seed": maybe(numbers),
        "repetition_penalty": maybe(st.floats(-1, 3, allow_nan=False)),
        "presence_penalty": maybe(st.floats(-3, 3, allow_nan=False)),
        "frequency_penalty": maybe(st.floats(-3, 3, allow_nan=False)),
        "stop": maybe(st.one_of(texts, st.lists(texts, max_size=20))),
        "stream": st.booleans(),
        "stream_options": maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
        "logprobs": maybe(st.booleans()),
        "top_logprobs": maybe(st.integers(-2, 25)),
        "n": maybe(small_ints),
        "tools": maybe(openai_tools),
        "tool_choice": maybe(
            st.one_of(
                st.sampled_from(["auto", "none", "required", "any"]),
                st.just({"type": "function", "function": {"name": "get_weather"}}),
            )
        ),
        "parallel_tool_calls": maybe(st.booleans()),
        "response_format": maybe(
            st.one_of(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "xml"])}),
                st.fixed_dictionaries(
                    {
                        "type": st.just("json_schema"),
                        "json_schema": st.fixed_dictionaries(
                            {"name": st.just("x")}, optional={"schema": schema_objects}
                        ),
                    }
                ),
            )
        ),
        "chat_template_kwargs": maybe(
            st.dictionaries(st.text(max_size=6), json_values, max_size=2)
        ),
        "reasoning_format": maybe(st.sampled_from(["auto", "none", "weird"])),
    },
)


def anthropic_messages() -> st.SearchStrategy:
    block = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": maybe(texts)}),
        st.fixed_dictionaries(
            {
                "type": st.just("tool_use"),
                "id": maybe(texts),
                "name": maybe(texts),
                "input": maybe(st.dictionaries(st.text(max_size=4), json_values, max_size=2)),
            }
        ),
        st.fixed_dictionaries(
            {"type": st.just("tool_result"), "tool_use_id": maybe(texts)},
            optional={"content": st.one_of(texts, json_values), "is_error": st.booleans()},
        ),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["thinking", "redacted_thinking", "image", "document"])},
            optional={"thinking": texts, "signature": texts, "source": json_values},
        ),
    )
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "tool", ""])},
        optional={"content": st.one_of(texts, st.lists(block, max_size=3), st.none(), numbers)},
    )
    return st.lists(message, max_size=4)


ANTHROPIC_WIDE = dict(
    messages=st.one_of(anthropic_messages(), json_values),
    **{
        "model": maybe(texts),
        "max_tokens": maybe(small_ints),
        "system": maybe(
            st.one_of(
                texts, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}))
            )
        ),
        "temperature": maybe(st.floats(-1, 2, allow_nan=False)),
        "top_p": maybe(st.floats(-0.5, 1.5, allow_nan=False)),
        "top_k": maybe(st.one_of(small_ints, st.integers(0, 1 << 20))),
        "stop_sequences": maybe(st.lists(texts, max_size=5)),
        "stream": st.booleans(),
        "tools": maybe(
            st.lists(
                st.fixed_dictionaries(
                    {"name": maybe(texts)},
                    optional={
                        "input_schema": schema_objects,
                        "type": st.sampled_from(["custom", "bash_20250124"]),
                    },
                ),
                max_size=2,
            )
        ),
        "tool_choice": maybe(
            st.one_of(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["auto", "any", "none", "tool", "x"])}
                ),
                st.just({"type": "tool", "name": "get_weather"}),
            )
        ),
        "thinking": maybe(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["enabled", "disabled", "adaptive", "x"])},
                optional={"budget_tokens": st.integers(-5, 5000)},
            )
        ),
        "metadata": maybe(json_values),
    },
)


def mutated(valid: st.SearchStrategy, wide: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """A valid request with up to two fields replaced by wide (often invalid) values."""
    keys = sorted(wide)
    mutation = st.sampled_from(keys).flatmap(lambda k: st.tuples(st.just(k), wide[k]))
    return st.tuples(valid, st.lists(mutation, max_size=2)).map(
        lambda t: {k: v for k, v in {**t[0], **dict(t[1])}.items() if v is not None}
    )


clean = st.text(max_size=30)  # no lone surrogates
weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
valid_openai = st.fixed_dictionaries(
    {
        "model": st.just("m"),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["system", "user", "assistant"]), "content": clean}
            ),
            max_size=2,
        ).map(lambda m: [*m, {"role": "user", "content": "hi"}]),
        "max_tokens": st.integers(1, 8),
    },
    optional={
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.05, 1),
        "top_k": st.integers(0, 50),
        "seed": st.integers(0, 1 << 40),
        "stop": st.lists(clean, max_size=3),
        "stream": st.booleans(),
        "stream_options": st.just({"include_usage": True}),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 5),
        "tools": st.just([weather]),
        "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "response_format": st.sampled_from(
            [
                {"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            ]
        ),
    },
)
valid_anthropic = st.fixed_dictionaries(
    {
        "model": st.just("m"),
        "max_tokens": st.integers(1, 8),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "assistant"]), "content": clean}
            ),
            max_size=2,
        ).map(lambda m: [*m, {"role": "user", "content": "hi"}]),
    },
    optional={
        "system": clean,
        "temperature": st.floats(0, 1),
        "top_k": st.integers(0, 50),
        "stop_sequences": st.lists(clean, max_size=3),
        "stream": st.booleans(),
        "tools": st.just(
            [{"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}]
        ),
        "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}]),
        "thinking": st.sampled_from(
            [{"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024}]
        ),
    },
)
openai_bodies = mutated(valid_openai, OPENAI_WIDE)
anthropic_bodies = mutated(valid_anthropic, ANTHROPIC_WIDE)


# ---- checks --------------------------------------------------------------------------------


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str) -> Any:
    return json.loads(text, parse_constant=_no_constants)


def check_error(path: str, r: httpx.Response) -> None:
    body = strict_json(r.text)
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    else:
        err = body["error"]
        assert isinstance(err["message"], str) and err["message"], body
        assert set(err) == {"message", "type", "param", "code"}, body


def check_stream(path: str, text: str) -> None:
    frames = [f for f in text.split("\n\n") if f.strip()]
    assert frames, "empty stream"
    datas = [line[6:] for f in frames for line in f.split("\n") if line.startswith("data: ")]
    if path in ("/v1/chat/completions", "/v1/completions"):
        assert datas[-1] == "[DONE]" or "error" in strict_json(datas[-1]), datas[-3:]
        for d in datas[:-1] if datas[-1] == "[DONE]" else datas:
            strict_json(d)
    elif path == "/v1/responses":
        events = [strict_json(d) for d in datas]
        ends = ("response.completed", "response.incomplete", "response.failed")
        assert events[-1]["type"] in ends, events[-3:]
    else:
        events = [strict_json(d) for d in datas]
        assert events[-1]["type"] in ("message_stop", "error"), events[-3:]


def send(sp, path: str, content: bytes, stream: bool) -> None:
    headers = {"content-type": "application/json"}
    if stream:
        with sp.client.stream("POST", path, content=content, headers=headers) as r:
            text = r.read().decode()
            status = r.status_code
            ctype = r.headers.get("content-type", "")
    else:
        r = sp.client.post(path, content=content, headers=headers)
        text, status, ctype = r.text, r.status_code, r.headers.get("content-type", "")
    assert status < 500, (status, text[:500], content[:500])
    sp.statuses[(path, status)] += 1
    if status >= 400:
        check_error(path, httpx.Response(status, text=text))
    elif ctype.startswith("text/event-stream"):
        check_stream(path, text)
    else:
        strict_json(text)
    sp.sent += 1
    if sp.sent % CHECK_EVERY == 0:
        still_serves(sp)


def still_serves(sp) -> None:
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = sp.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    r = sp.client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    health = sp.client.get("/health").json()
    assert health["status"] == "ok"


FUZZ = settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)


@FUZZ
@given(body=openai_bodies, count=st.integers(0, 5))
def test_chat_completions_requests(fuzz_server, body, count):
    path = "/v1/chat/completions/count_tokens" if count == 0 else "/v1/chat/completions"
    stream = bool(body.get("stream")) and count != 0
    send(fuzz_server, path, json.dumps(body).encode(), stream)


completion_bodies = mutated(
    st.fixed_dictionaries(
        {
            "model": st.just("m"),
            "prompt": st.one_of(clean, st.lists(clean, min_size=1, max_size=3)),
        },
        optional={
            "max_tokens": st.integers(0, 8),
            "stream": st.booleans(),
            "echo": st.booleans(),
            "logprobs": st.integers(0, 5),
            "stop": st.lists(clean, max_size=2),
            "seed": st.integers(0, 1 << 40),
            "temperature": st.floats(0, 2),
        },
    ),
    {
        "prompt": st.one_of(json_values, st.lists(st.integers(-5, 1 << 20), max_size=5)),
        "suffix": maybe(texts),
        "max_tokens": maybe(small_ints),
        "n": maybe(small_ints),
        "logprobs": maybe(st.integers(-2, 30)),
        "top_k": maybe(st.integers(0, 1 << 20)),
        "seed": maybe(numbers),
        "echo": maybe(st.booleans()),
        "stream_options": maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
    },
)


@settings(FUZZ, max_examples=200)
@given(body=completion_bodies)
def test_completions_requests(fuzz_server, body):
    send(fuzz_server, "/v1/completions", json.dumps(body).encode(), bool(body.get("stream")))


@FUZZ
@given(body=anthropic_bodies, count=st.booleans())
def test_messages_requests(fuzz_server, body, count):
    path = "/v1/messages/count_tokens" if count else "/v1/messages"
    send(fuzz_server, path, json.dumps(body).encode(), bool(body.get("stream")) and not count)


ROUTES = [
    "/v1/chat/completions",
    "/v1/chat/completions/count_tokens",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/tokenize",
    "/detokenize",
    "/v1/cancel",
]


@settings(FUZZ, max_examples=300)
@given(
    path=st.sampled_from(ROUTES),
    raw=st.one_of(
        json_values.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
        st.integers(MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH * 3).map(
            lambda n: ('{"messages": ' + "[" * n + "]" * n + "}").encode()
        ),
    ),
)
def test_any_body_on_any_route(fuzz_server, path, raw):
    if path == "/v1/cancel" and not raw.strip().startswith(b"{"):
        raw = b"[" + raw  # an empty body there means "cancel everything": keep it invalid
    send(fuzz_server, path, raw, stream=False)


def test_still_serving_at_the_end(fuzz_server):
    still_serves(fuzz_server)
    # The generated requests reached generation, not only validation.
    seen = fuzz_server.statuses
    print(sorted(seen.items()))
    assert seen[("/v1/chat/completions", 200)] >= 25, seen
    assert seen[("/v1/messages", 200)] >= 25, seen
