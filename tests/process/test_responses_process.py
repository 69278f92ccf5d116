"""The Responses API in a real server process on the tiny random model: the store flags,
and a streamed response from the real engine validated event by event."""

from __future__ import annotations

import httpx
from responses_spec import parse_sse, validate_event, validate_response
from support import free_port


def test_store_size_flag_evicts_the_oldest(server_factory, tiny_model_dir):
    port = free_port()
    srv = server_factory(
        ["-m", str(tiny_model_dir), "--port", str(port), "--responses-store-size", "2"]
    )
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, "temperature": 0}
    ids = []
    for _ in range(3):
        r = httpx.post(srv.base_url + "/v1/responses", json=body, timeout=60)
        assert r.status_code == 200, r.text
        validate_response(r.json())
        ids.append(r.json()["id"])
    codes = [httpx.get(f"{srv.base_url}/v1/responses/{rid}").status_code for rid in ids]
    assert codes == [404, 200, 200]
    with httpx.stream(
        "POST", srv.base_url + "/v1/responses", json={**body, "stream": True}, timeout=60
    ) as resp:
        events = parse_sse(list(resp.iter_lines()))
    for e in events:
        validate_event(e)
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    final = events[-1]["response"]
    assert 0 < final["usage"]["output_tokens"] <= 4
    stored = httpx.get(f"{srv.base_url}/v1/responses/{final['id']}").json()
    assert stored == final
