"""A browser-safe localhost: what a web page can and cannot do, what desktop clients keep.

Each test sends the requests a browser would send (preflight, simple requests, form posts,
DNS rebinding) or that Jan and other desktop clients send, through the real server stack.
"""

from __future__ import annotations

import httpx
import pytest
from support import schema_validator

from mlx_server.server.browser_guard import BrowserPolicy, host_name

ERROR = schema_validator("ErrorResponse")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
JAN = "tauri://localhost"
EVIL = "https://evil.example"


@pytest.fixture
def srv(scripted_factory):
    return scripted_factory(api_key="sk-test")


def auth(**extra: str) -> dict[str, str]:
    return {"Authorization": "Bearer sk-test", **extra}


def chat(srv, headers: dict[str, str], **kw) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/chat/completions", headers=headers, **kw)


def test_preflight_from_jan_is_answered_without_a_key(srv):
    r = httpx.options(
        srv.base_url + "/v1/chat/completions",
        headers={
            "Origin": JAN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
        },
    )
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == JAN
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
    for h in ("authorization", "x-api-key", "anthropic-version", "content-type", "x-stainless-os"):
        assert h in allowed


def test_preflight_from_another_origin_is_refused(srv):
    r = httpx.options(
        srv.base_url + "/v1/chat/completions",
        headers={"Origin": EVIL, "Access-Control-Request-Method": "POST"},
    )
    assert r.status_code == 403
    assert "access-control-allow-origin" not in r.headers
    ERROR.validate(r.json())
    assert "evil.example" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "ctype,body",
    [
        ("text/plain", '{"model":"m","messages":[{"role":"user","content":"hi"}]}'),
        ("application/x-www-form-urlencoded", "model=m&messages=hi"),
        ("multipart/form-data; boundary=x", "--x--"),
        ("application/json", '{"model":"m","messages":[{"role":"user","content":"hi"}]}'),
    ],
)
def test_requests_from_other_pages_are_refused_before_any_work(srv, ctype, body):
    r = chat(srv, auth(Origin=EVIL, **{"Content-Type": ctype}), content=body)
    assert r.status_code == 403
    assert "access-control-allow-origin" not in r.headers
    ERROR.validate(r.json())
    assert srv.engine.requests == []


def test_sandboxed_page_null_origin_is_refused(srv):
    r = chat(srv, auth(Origin="null"), json=CHAT)
    assert r.status_code == 403 and srv.engine.requests == []


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", None])
def test_allowed_page_must_send_json(srv, ctype):
    headers = auth(Origin="http://localhost:3000")
    if ctype:
        headers["Content-Type"] = ctype
    r = chat(srv, headers, content=b'{"model":"m","messages":[{"role":"user","content":"hi"}]}')
    if ctype is None:  # httpx sends no Content-Type for raw bytes
        assert "content-type" not in r.request.headers
    assert r.status_code == 415
    ERROR.validate(r.json())
    assert r.json()["error"]["code"] == "unsupported_media_type"
    assert srv.engine.requests == []


def test_jan_origin_works_and_gets_cors_headers(srv):
    srv.engine.push("ok")
    r = chat(srv, auth(Origin=JAN), json=CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    assert r.headers["access-control-allow-origin"] == JAN
    assert "Origin" in r.headers["vary"]
    for origin in ("http://tauri.localhost", "https://tauri.localhost", "http://127.0.0.1:1337"):
        r = httpx.get(srv.base_url + "/v1/models", headers=auth(Origin=origin))
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin


def test_a_page_may_read_the_ignored_fields_header(srv):
    r = chat(srv, auth(Origin=JAN), json={**CHAT, "top_K": 3})
    assert r.status_code == 200 and r.headers["x-mlx-server-ignored-fields"] == "top_K"
    exposed = [h.strip().lower() for h in r.headers["access-control-expose-headers"].split(",")]
    assert "x-mlx-server-ignored-fields" in exposed
    body = {**CHAT, "stream": True, "top_K": 3}
    with httpx.stream(
        "POST", srv.base_url + "/v1/chat/completions", json=body, headers=auth(Origin=JAN)
    ) as s:
        assert "x-mlx-server-ignored-fields" in s.headers["access-control-expose-headers"]
        assert "data: [DONE]" in list(s.iter_lines())
    # No Origin (curl, SDKs): no CORS headers at all.
    r = chat(srv, auth(), json=CHAT)
    assert "access-control-expose-headers" not in r.headers


def test_streaming_keeps_cors_headers(srv):
    srv.engine.push("a", "b")
    body = {**CHAT, "stream": True}
    with httpx.stream(
        "POST", srv.base_url + "/v1/chat/completions", json=body, headers=auth(Origin=JAN)
    ) as r:
        assert r.headers["access-control-allow-origin"] == JAN
        assert "data: [DONE]" in list(r.iter_lines())


def test_clients_without_origin_are_unaffected(srv):
    # curl -d '{...}' sends a form content type; SDKs and editors send JSON; none send Origin.
    srv.engine.push("one")
    r = chat(
        srv,
        auth(**{"Content-Type": "application/x-www-form-urlencoded"}),
        content=b'{"model":"m","messages":[{"role":"user","content":"hi"}]}',
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "one"
    assert "access-control-allow-origin" not in r.headers


def test_cancel_without_body_works_from_jan_and_without_origin(srv):
    for headers in (auth(Origin=JAN), auth()):
        r = httpx.post(srv.base_url + "/v1/cancel", headers=headers)
        assert r.status_code == 200 and r.json()["status"] == "no_active_generation"


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.nip.io"])
def test_rebinding_host_is_refused(srv, host):
    srv.engine.push("secret")
    for path in ("/v1/models", "/health"):
        r = httpx.get(srv.base_url + path, headers=auth(Host=host))
        assert r.status_code == 403, path
        ERROR.validate(r.json())
    # Same-origin for the rebound page: its POST carries its own Origin and Host.
    r = chat(srv, auth(Host=host, Origin=f"http://{host}"), json=CHAT)
    assert r.status_code == 403 and srv.engine.requests == []


@pytest.mark.parametrize(
    "host", ["localhost", "localhost:9", "127.0.0.1", "[::1]:8080", "LOCALHOST"]
)
def test_loopback_hosts_are_answered(srv, host):
    assert httpx.get(srv.base_url + "/health", headers={"Host": host}).status_code == 200


def test_anthropic_routes_use_their_envelope(srv):
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(srv.base_url + "/v1/messages", json=body, headers=auth(Origin=EVIL))
    assert r.status_code == 403
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "permission_error"
    r = httpx.post(
        srv.base_url + "/v1/messages",
        content=b"{}",
        headers=auth(Origin=JAN, **{"Content-Type": "text/plain"}),
    )
    assert r.status_code == 415 and r.json()["type"] == "error"


def test_flags_widen_hosts_and_origins(scripted_factory):
    policy = BrowserPolicy.from_flags("127.0.0.1", "myhost.lan", "https://app.example:8443/")
    srv = scripted_factory(app_kw={"browser": policy})
    r = httpx.get(
        srv.base_url + "/v1/models",
        headers={"Host": "myhost.lan:8080", "Origin": "https://app.example:8443"},
    )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example:8443"
    r = httpx.get(srv.base_url + "/v1/models", headers={"Origin": "https://app.example"})
    assert r.status_code == 403  # another port is another origin


def test_policy_rules():
    assert host_name("[::1]:8080") == "::1" and host_name("LocalHost.:80") == "localhost"
    p = BrowserPolicy.from_flags("192.168.1.5", "", "")
    assert p.host_allowed("192.168.1.5:8080") and p.host_allowed("app.localhost")
    assert not p.host_allowed("192.168.1.6:8080") and not p.host_allowed("evil.example")
    wild = BrowserPolicy.from_flags("0.0.0.0", "", "")
    assert wild.host_allowed("10.0.0.7:8080") and wild.host_allowed("[fe80::1]:8080")
    assert not wild.host_allowed("rebind.example:8080")
    electron = BrowserPolicy.from_flags("127.0.0.1", "", "file://,http://my-app.test:5173")
    assert electron.origin_allowed("file://") and electron.origin_allowed("http://my-app.test:5173")
    assert not electron.origin_allowed("null") and not BrowserPolicy().origin_allowed("file://")
    anyhost = BrowserPolicy.from_flags("127.0.0.1", "*", "*")
    assert anyhost.host_allowed("whatever.example") and anyhost.origin_allowed(EVIL)
    default = BrowserPolicy()
    for origin in (JAN, "http://localhost", "https://127.0.0.1:5173", "http://[::1]:80"):
        assert default.origin_allowed(origin), origin
    for origin in ("http://localhost.evil.example", "file://", "null", "tauri://evil", EVIL):
        assert not default.origin_allowed(origin), origin
