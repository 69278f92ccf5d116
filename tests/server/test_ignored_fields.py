"""Unknown top-level request fields: accepted, logged once per route and field, and listed
in the ``x-mlx-server-ignored-fields`` response header, on every API."""

from __future__ import annotations

import httpx
import pytest

from mlx_server.server.ignored_fields import HEADER, printable

USER = [{"role": "user", "content": "hi"}]
BODIES = {
    "/v1/chat/completions": {"messages": USER, "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/messages": {"model": "m", "messages": USER, "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
}


@pytest.mark.parametrize("path", list(BODIES))
def test_unknown_fields_are_listed_in_the_header(scripted, path):
    body = {**BODIES[path], "max_token": 5, "top_K": 3}
    r = httpx.post(f"{scripted.base_url}{path}", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers[HEADER] == "max_token, top_K"
    known = httpx.post(f"{scripted.base_url}{path}", json=BODIES[path], timeout=30)
    assert known.status_code == 200
    assert HEADER not in known.headers


def test_streamed_and_refused_requests_carry_it_too(scripted):
    url = f"{scripted.base_url}/v1/chat/completions"
    body = {**BODIES["/v1/chat/completions"], "stream": True, "frobnicate": 1}
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        assert r.headers[HEADER] == "frobnicate"
        assert b"[DONE]" in r.read()
    bad = httpx.post(url, json={**body, "temperature": 9}, timeout=30)
    assert bad.status_code == 400
    assert bad.headers[HEADER] == "frobnicate"


def test_logged_once_per_route_and_field(scripted, capsys):
    url = f"{scripted.base_url}/v1/chat/completions"
    body = {**BODIES["/v1/chat/completions"], "logged_once_field": True}
    for _ in range(2):
        assert httpx.post(url, json=body, timeout=30).status_code == 200
    lines = [line for line in capsys.readouterr().out.splitlines() if "'logged_once_field'" in line]
    assert lines == [
        "[mlx] Warning: unknown field 'logged_once_field' on POST /v1/chat/completions "
        "was ignored (it has no effect)"
    ]


def test_hostile_names_cannot_break_the_header(scripted):
    body = {**BODIES["/v1/chat/completions"], "a\r\nSet-Cookie: x": 1, "é,b": 2, "z" * 500: 3}
    r = httpx.post(f"{scripted.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200
    assert "set-cookie" not in r.headers
    names = r.headers[HEADER].split(", ")
    assert names == sorted(printable(k) for k in list(body)[2:])
    assert all(len(n) <= 64 for n in names)
