"""The Responses API through the real server stack, driven by a scripted engine.

Every response body and stream event is validated against the vendored OpenAI schemas
(tests/specs/openai-responses.schema.json); the SDK runs with strict response validation.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from clients import openai_client, wait_until
from payloads import WEATHER, WEATHER_CALL, responses_tool
from responses_spec import (
    parse_sse,
    validate_error,
    validate_event,
    validate_item_list,
    validate_response,
)
from scripted_engine import ScriptedEngine

TOOL = responses_tool(WEATHER, strict=True)
CALL = WEATHER_CALL


def post(srv, body: dict, **kw) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/responses", json=body, timeout=30, **kw)


def stream_events(srv, body: dict) -> list[dict]:
    with httpx.stream(
        "POST", srv.base_url + "/v1/responses", json={**body, "stream": True}, timeout=30
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(list(resp.iter_lines()))
    for e in events:
        validate_event(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def prompt_text(srv) -> str:
    return srv.service.tokenizer.decode(srv.engine.requests[-1].prompt_tokens)


# ---- create ------------------------------------------------------------------------------


def test_create_plain_text(scripted):
    scripted.engine.push("Hello", " world", "!")
    r = post(scripted, {"model": "anything", "input": "hi", "metadata": {"k": "v"}})
    assert r.status_code == 200, r.text
    body = r.json()
    validate_response(body)
    assert body["id"].startswith("resp_") and body["object"] == "response"
    assert body["model"] == "anything" and body["status"] == "completed"
    assert body["metadata"] == {"k": "v"} and body["store"] is True
    assert body["error"] is None and body["incomplete_details"] is None
    [msg] = body["output"]
    assert msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["content"] == [
        {"type": "output_text", "text": "Hello world!", "annotations": [], "logprobs": []}
    ]
    usage = body["usage"]
    assert usage["output_tokens"] == 3 and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + 3
    assert usage["input_tokens_details"]["cached_tokens"] == 0
    assert usage["output_tokens_details"]["reasoning_tokens"] == 0


def test_sdk_create_strict(scripted):
    scripted.engine.push("Hi", " there")
    r = openai_client(scripted).responses.create(
        model="m", input="hello", instructions="Be brief.", temperature=0.2, top_p=0.5
    )
    assert r.output_text == "Hi there"
    assert r.instructions == "Be brief." and r.temperature == 0.2 and r.top_p == 0.5
    req = scripted.engine.requests[-1]
    assert req.sampling.temperature == 0.2 and req.sampling.top_p == 0.5
    text = prompt_text(scripted)
    assert text.index("Be brief.") < text.index("hello")


def test_default_sampling_is_the_specs(scripted):
    scripted.engine.push("ok")
    body = post(scripted, {"model": "m", "input": "hi"}).json()
    assert body["temperature"] == 1.0 and body["top_p"] == 1.0
    assert scripted.engine.requests[-1].sampling.temperature == 1.0


def test_reasoning_then_text_stream_event_sequence(scripted):
    scripted.engine.push("<think>", "Let me", " see", "</think>", "The answer", " is 4")
    events = stream_events(scripted, {"model": "m", "input": "2+2?"})
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []
    assert events[6]["text"] == "Let me see"
    assert events[13]["text"] == "The answer is 4"
    assert [e["output_index"] for e in events[2:9]] == [0] * 7
    assert [e["output_index"] for e in events[9:16]] == [1] * 7
    final = events[-1]["response"]
    validate_response(final)
    reasoning, message = final["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me see"}]
    assert message["content"][0]["text"] == "The answer is 4"
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    assert events[8]["item"] == reasoning and events[15]["item"] == message


def test_sdk_stream_strict(scripted):
    scripted.engine.push("x", "y", "z")
    with openai_client(scripted).responses.stream(model="m", input="hi") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert deltas == ["x", "y", "z"]
    assert final.output_text == "xyz" and final.status == "completed"


@pytest.mark.parametrize("stream", [False, True])
def test_max_output_tokens_is_incomplete(scripted, stream):
    scripted.engine.push(*["w "] * 10)
    body = {"model": "m", "input": "hi", "max_output_tokens": 3}
    if stream:
        events = stream_events(scripted, body)
        assert events[-1]["type"] == "response.incomplete"
        final = events[-1]["response"]
    else:
        final = post(scripted, body).json()
        validate_response(final)
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["max_output_tokens"] == 3 and final["usage"]["output_tokens"] == 3
    assert final["output"][0]["status"] == "incomplete"


def test_stopping_inside_the_reasoning_completes_with_the_reasoning_incomplete(scripted):
    scripted.engine.push("<think>", "still", " thinking")
    events = stream_events(scripted, {"model": "m", "input": "hi"})
    assert events[-1]["type"] == "response.completed"
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["incomplete_details"] is None
    [reasoning] = final["output"]
    assert reasoning["type"] == "reasoning" and reasoning["status"] == "incomplete"
    assert reasoning["content"][0]["text"] == "still thinking"
    scripted.engine.push("<think>", "a", " b", " c")
    cut = post(scripted, {"model": "m", "input": "hi", "max_output_tokens": 2}).json()
    validate_response(cut)
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}


def test_generation_error_stream_ends_failed(scripted):
    scripted.engine.push("partial", finish="error")
    events = stream_events(scripted, {"model": "m", "input": "hi"})
    assert events[-1]["type"] == "response.failed"
    final = events[-1]["response"]
    assert final["status"] == "failed" and final["error"]["code"] == "server_error"
    assert httpx.get(scripted.base_url + "/health").status_code == 200


def test_internal_fault_mid_stream_sends_error_then_failed(scripted, monkeypatch):
    from mlx_server.protocols.responses.stream import ResponseEncoder

    real = ResponseEncoder.event

    def faulty(self, ev):
        if "boom" in getattr(ev, "text", ""):
            raise RuntimeError("encoder fault")
        return real(self, ev)

    monkeypatch.setattr(ResponseEncoder, "event", faulty)
    scripted.engine.push("fine ", "boom", " never")
    events = stream_events(scripted, {"model": "m", "input": "hi"})
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "server_error" and "RuntimeError" in events[-2]["message"]
    assert events[-1]["response"]["status"] == "failed"
    wait_until(lambda: scripted.engine.active_count == 0)


def test_generation_error_non_streaming_is_500_and_stored_failed(scripted):
    scripted.engine.push("partial", finish="error")
    r = post(scripted, {"model": "m", "input": "hi"})
    assert r.status_code == 500
    validate_error(r.json())
    assert r.json()["error"]["type"] == "server_error"
    rid = scripted.engine.requests[-1].request_id
    stored = httpx.get(f"{scripted.base_url}/v1/responses/{rid}").json()
    validate_response(stored)
    assert stored["status"] == "failed" and stored["error"]["message"] == "scripted failure"


# ---- tools -------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_output_item(scripted, stream):
    scripted.engine.push("Checking. ", CALL)
    body = {"model": "m", "input": "Weather in Paris?", "tools": [TOOL]}
    if stream:
        events = stream_events(scripted, body)
        types = [e["type"] for e in events]
        start = next(
            i
            for i, e in enumerate(events)
            if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"
        )
        added = events[start]
        assert types[start - 3 : start] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
        ]
        assert set(types[start + 1 : -3]) == {"response.function_call_arguments.delta"}
        assert types[-3:] == [
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert added["output_index"] == 1 and events[-2]["output_index"] == 1
        assert added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
        args = "".join(
            e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
        )
        assert json.loads(args) == {"city": "Paris"}
        final = events[-1]["response"]
    else:
        final = post(scripted, body).json()
    validate_response(final)
    message, call = final["output"]
    assert message["content"][0]["text"] == "Checking."
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["status"] == "completed"
    assert final["tools"] == [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": TOOL["parameters"],
            "strict": True,
        }
    ]
    assert final["tool_choice"] == "auto" and final["parallel_tool_calls"] is True


def test_tool_round_trip_with_function_call_output(scripted):
    c = openai_client(scripted)
    scripted.engine.push(CALL)
    first = c.responses.create(model="m", input="Weather in Paris?", tools=[TOOL], store=False)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    scripted.engine.push("It is ", "sunny.")
    second = c.responses.create(
        model="m",
        tools=[TOOL],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "22C, sun"},
        ],
    )
    assert second.output_text == "It is sunny."
    text = prompt_text(scripted)
    assert '"name": "get_weather"' in text and "22C, sun" in text and "<|im_start|>tool" in text
    assert text.index("Weather in Paris?") < text.index("get_weather") < text.index("22C, sun")


def test_parallel_tool_calls_false_keeps_first(scripted):
    scripted.engine.push(CALL, CALL.replace("Paris", "Rome"))
    body = post(
        scripted,
        {"model": "m", "input": "x", "tools": [TOOL], "parallel_tool_calls": False},
    ).json()
    validate_response(body)
    calls = [o for o in body["output"] if o["type"] == "function_call"]
    assert len(calls) == 1 and body["parallel_tool_calls"] is False


def test_tool_choice_none_hides_tools(scripted):
    scripted.engine.push(CALL)
    body = post(scripted, {"model": "m", "input": "x", "tools": [TOOL], "tool_choice": "none"})
    body = body.json()
    validate_response(body)
    assert "get_weather" not in prompt_text(scripted)
    assert [o["type"] for o in body["output"]] == ["message"]


# ---- input forms -------------------------------------------------------------------------


def test_input_items_render_in_order(scripted):
    scripted.engine.push("ok")
    items = [
        {"role": "developer", "content": "D1"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "U1"}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "R1"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "A1", "annotations": []}],
        },
        {"role": "user", "content": "U2"},
        {"role": "user", "content": "U3"},
    ]
    r = post(scripted, {"model": "m", "input": items, "instructions": "SYS"})
    assert r.status_code == 200, r.text
    text = prompt_text(scripted)
    order = ["SYS", "D1", "U1", "A1", "U2", "U3"]
    assert [text.index(p) for p in order] == sorted(text.index(p) for p in order)
    # instructions and developer text share one system turn; U2 and U3 one user turn
    assert text.count("<|im_start|>system") == 1 and text.count("<|im_start|>user") == 2


def test_bad_requests_name_the_part(scripted):
    cases = [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
            "input_image",
        ),
        ({"input": [{"type": "file_search_call"}]}, "input[0].type", "file_search_call"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role", "wizard"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input[0].arguments",
            "JSON",
        ),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type", "xml"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
        ({"background": True}, "background", "background"),
        ({"temperature": 5}, "temperature", "temperature"),
        ({"input": []}, "input", "empty"),
    ]
    for extra, param, word in cases:
        body = {"model": "m", "input": "hi", **extra}
        r = post(scripted, body)
        assert r.status_code == 400, (extra, r.text)
        validate_error(r.json())
        err = r.json()["error"]
        assert err["param"] == param, (extra, err)
        assert word in err["message"], (extra, err)
        assert err["type"] == "invalid_request_error"


def test_tool_choice_naming_unknown_function(scripted):
    r = post(
        scripted,
        {
            "model": "m",
            "input": "hi",
            "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "nope"},
        },
    )
    assert r.status_code == 400
    assert "nope" in r.json()["error"]["message"]


def test_reasoning_effort_reaches_the_template(scripted):
    scripted.engine.push("ok")
    scripted.engine.push("ok")
    seen = []
    real = scripted.service.render

    def spy(chat):
        seen.append(chat.template_kwargs)
        return real(chat)

    scripted.service.render = spy
    try:
        for effort in ("none", "high"):
            r = post(scripted, {"model": "m", "input": "hi", "reasoning": {"effort": effort}})
            assert r.status_code == 200
            assert r.json()["reasoning"]["effort"] == effort
    finally:
        scripted.service.render = real
    assert seen[0] == {"enable_thinking": False}
    assert seen[-1] == {"enable_thinking": True, "reasoning_effort": "high"}


# ---- limits and errors, as on the chat route ----------------------------------------------


def test_context_length_exceeded(scripted):
    r = post(scripted, {"model": "m", "input": "hi " * 50, "max_output_tokens": 500})
    assert r.status_code == 400
    validate_error(r.json())
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "input"


def test_body_too_large_413(scripted):
    big = b'{"model": "m", "input": "' + b"a" * (11 * 1024 * 1024) + b'"}'
    r = httpx.post(
        scripted.base_url + "/v1/responses",
        content=big,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413
    validate_error(r.json())


def test_queue_full_503_with_retry_after(scripted_factory):
    srv = scripted_factory(engine=ScriptedEngine(max_queue=0))
    r = post(srv, {"model": "m", "input": "hi"})
    assert r.status_code == 503 and r.headers["retry-after"]
    validate_error(r.json())


def test_auth_on_responses_routes(scripted_factory):
    srv = scripted_factory(api_key="k3y")
    for method, path in (
        ("POST", "/v1/responses"),
        ("GET", "/v1/responses/resp_x"),
        ("DELETE", "/v1/responses/resp_x"),
        ("POST", "/v1/responses/resp_x/cancel"),
        ("GET", "/v1/responses/resp_x/input_items"),
    ):
        r = httpx.request(method, srv.base_url + path, json={"model": "m", "input": "hi"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    srv.engine.push("ok")
    r = openai_client(srv, api_key="k3y").responses.create(model="m", input="hi")
    assert r.output_text == "ok"
    with pytest.raises(openai.AuthenticationError):
        openai_client(srv, api_key="bad").responses.create(model="m", input="hi")


# ---- stored responses --------------------------------------------------------------------


def test_retrieve_input_items_delete(scripted):
    c = openai_client(scripted)
    scripted.engine.push("stored")
    items = [
        {"role": "user", "content": "one"},
        {"role": "user", "content": [{"type": "input_text", "text": "two"}]},
    ]
    r = c.responses.create(model="m", input=items)
    got = httpx.get(f"{scripted.base_url}/v1/responses/{r.id}").json()
    validate_response(got)
    assert got == r.model_dump(mode="json", exclude_unset=True)
    assert c.responses.retrieve(r.id).output_text == "stored"
    listed = httpx.get(f"{scripted.base_url}/v1/responses/{r.id}/input_items").json()
    validate_item_list(listed)
    texts = [i["content"][0]["text"] for i in listed["data"]]
    assert texts == ["two", "one"] and listed["has_more"] is False
    page = c.responses.input_items.list(r.id, order="asc", limit=1)
    assert [i.content[0].text for i in page.data] == ["one"] and page.has_more
    rest = c.responses.input_items.list(r.id, order="asc", after=page.data[0].id)
    assert [i.content[0].text for i in rest.data] == ["two"]
    d = httpx.delete(f"{scripted.base_url}/v1/responses/{r.id}")
    assert d.json() == {"id": r.id, "object": "response.deleted", "deleted": True}
    for path in (f"/v1/responses/{r.id}", f"/v1/responses/{r.id}/input_items"):
        gone = httpx.get(scripted.base_url + path)
        assert gone.status_code == 404
        validate_error(gone.json())
    assert httpx.delete(f"{scripted.base_url}/v1/responses/{r.id}").status_code == 404
    assert httpx.post(f"{scripted.base_url}/v1/responses/{r.id}/cancel").status_code == 404


def test_store_false_is_not_kept(scripted):
    scripted.engine.push("x")
    body = post(scripted, {"model": "m", "input": "hi", "store": False}).json()
    assert body["store"] is False
    assert httpx.get(f"{scripted.base_url}/v1/responses/{body['id']}").status_code == 404
    r = post(scripted, {"model": "m", "input": "more", "previous_response_id": body["id"]})
    assert r.status_code == 400
    validate_error(r.json())
    err = r.json()["error"]
    assert err["code"] == "previous_response_not_found"
    assert err["param"] == "previous_response_id" and body["id"] in err["message"]


def test_previous_response_id_continues_the_conversation(scripted):
    c = openai_client(scripted)
    scripted.engine.push("<think>", "hm", "</think>", "Paris.")
    first = c.responses.create(model="m", input="Capital of France?", instructions="OLD")
    scripted.engine.push(CALL)
    second = c.responses.create(
        model="m", input="Weather there?", previous_response_id=first.id, tools=[TOOL]
    )
    call = second.output[0]
    assert call.type == "function_call"
    scripted.engine.push("Sunny in Paris.")
    third = c.responses.create(
        model="m",
        previous_response_id=second.id,
        instructions="NEW",
        tools=[TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sun"}],
    )
    assert third.previous_response_id == second.id and third.output_text == "Sunny in Paris."
    text = prompt_text(scripted)
    order = ["NEW", "Capital of France?", "Paris.", "Weather there?", "get_weather", "sun"]
    assert [text.index(p) for p in order] == sorted(text.index(p) for p in order)
    assert "OLD" not in text  # instructions are not carried over
    listed = c.responses.input_items.list(third.id)
    assert [i.type for i in listed.data] == ["function_call_output"]


def test_store_is_bounded_lru():
    from mlx_server.protocols.responses.store import ResponseStore, StoredResponse

    store = ResponseStore(max_count=2, max_bytes=10_000)

    def entry(rid: str, size: int = 10) -> StoredResponse:
        return StoredResponse({"id": rid, "pad": "x" * size}, [], [])

    store.put(entry("a"))
    store.put(entry("b"))
    assert store.get("a") is not None  # a is now the most recent
    store.put(entry("c"))
    assert store.get("b") is None and store.get("a") and store.get("c")
    store.put(entry("big", 6_000))
    store.put(entry("big2", 6_000))
    assert store.get("big2") and store.get("big") is None and len(store) <= 2
    assert store.bytes <= 10_000
    store.put(entry("huge", 20_000))
    assert store.get("huge") is None


# ---- cancellation ------------------------------------------------------------------------


@contextmanager
def streamed(srv) -> Iterator[Iterator[str]]:
    """The lines of a streamed response to "go", while the stream is open."""
    body = {"model": "m", "input": "go", "stream": True}
    with httpx.stream("POST", srv.base_url + "/v1/responses", json=body, timeout=30) as resp:
        yield resp.iter_lines()


def test_cancel_endpoint_stops_a_stream(scripted):
    scripted.engine.push(*["x"] * 500, delay=0.01)
    with streamed(scripted) as lines:
        seen = []
        for line in lines:
            seen.append(line)
            if line.startswith("data: ") and '"response.output_text.delta"' in line:
                break
        rid = parse_sse(seen)[0]["response"]["id"]
        live = httpx.get(f"{scripted.base_url}/v1/responses/{rid}").json()
        assert live["status"] == "in_progress"
        validate_response(live)
        cancelled = httpx.post(f"{scripted.base_url}/v1/responses/{rid}/cancel", timeout=30)
        assert cancelled.status_code == 200
        events = parse_sse(seen + list(lines))
    body = cancelled.json()
    validate_response(body)
    assert body["status"] == "cancelled" and body["id"] == rid
    for e in events:
        validate_event(e)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["status"] == "cancelled"
    text = events[-1]["response"]["output"][0]["content"][0]["text"]
    assert 0 < len(text) < 500
    assert httpx.get(f"{scripted.base_url}/v1/responses/{rid}").json()["status"] == "cancelled"
    again = httpx.post(f"{scripted.base_url}/v1/responses/{rid}/cancel").json()
    assert again["status"] == "cancelled"


def test_delete_a_running_response_stops_it_and_keeps_nothing(scripted):
    scripted.engine.push(*["x"] * 1000, delay=0.01)
    with streamed(scripted) as lines:
        first = [next(lines) for _ in range(2)]
        rid = parse_sse(first)[0]["response"]["id"]
        d = httpx.delete(f"{scripted.base_url}/v1/responses/{rid}")
        assert d.json() == {"id": rid, "object": "response.deleted", "deleted": True}
        events = parse_sse(first + list(lines))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["status"] == "cancelled"
    assert httpx.get(f"{scripted.base_url}/v1/responses/{rid}").status_code == 404


def test_cancel_non_streaming(scripted):
    scripted.engine.push(*["x"] * 500, delay=0.01)
    out = {}
    t = threading.Thread(
        target=lambda: out.setdefault("r", post(scripted, {"model": "m", "input": "go"}))
    )
    t.start()
    wait_until(lambda: scripted.engine.active_count == 1)
    rid = scripted.engine.requests[-1].request_id
    assert rid.startswith("resp_")
    assert (
        httpx.post(scripted.base_url + "/v1/cancel", json={"id": rid}).json()["cancelled_count"]
        == 1
    )
    t.join(10)
    body = out["r"].json()
    validate_response(body)
    assert body["status"] == "cancelled" and body["id"] == rid
    assert len(body["output"][0]["content"][0]["text"]) < 500


def test_disconnect_stops_generation(scripted):
    scripted.engine.push(*["x"] * 1000, delay=0.01)
    with streamed(scripted) as it:
        first = [next(it) for _ in range(2)]
    rid = parse_sse(first)[0]["response"]["id"]
    wait_until(lambda: scripted.engine.active_count == 0)
    wait_until(
        lambda: (
            httpx.get(f"{scripted.base_url}/v1/responses/{rid}").json()["status"] != "in_progress"
        )
    )
    stored = httpx.get(f"{scripted.base_url}/v1/responses/{rid}").json()
    validate_response(stored)
    assert stored["status"] == "cancelled"
