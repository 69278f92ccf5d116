"""A connection whose request head does not arrive within --header-timeout-s is closed (as
nginx's client_header_timeout): blank lines only, nothing at all, or half a head. Complete
heads, slow bodies and idle keep-alive connections are not cut."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator

import pytest
from support import ServerProcess, serving
from tiny_model import build_tiny_model

HEADER_TIMEOUT_S = 3.0
# How long a test waits for the server to close a connection before it fails: the timeout
# plus room for a loaded machine.
CLOSE_DEADLINE_S = HEADER_TIMEOUT_S + 30


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    model = build_tiny_model(tmp_path_factory.mktemp("srv") / "tiny-model")
    args = ["-m", str(model), "--ctx-size", "256", "--header-timeout-s", str(HEADER_TIMEOUT_S)]
    with serving(args) as sp:
        yield sp


def _connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=CLOSE_DEADLINE_S)


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection; a socket timeout (the
    server held the connection past the deadline) fails the test."""
    received = b""
    deadline = time.monotonic() + CLOSE_DEADLINE_S
    while time.monotonic() < deadline:
        chunk = sock.recv(4096)
        if not chunk:
            return received
        received += chunk
    raise AssertionError(f"connection still open after {CLOSE_DEADLINE_S} s: {received!r}")


@pytest.mark.parametrize(
    "sent",
    [b"", b"\r\n\r\n\r\n", b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"],
    ids=["nothing", "blank-lines", "partial-head"],
)
def test_connection_without_a_complete_head_is_closed(server: ServerProcess, sent: bytes) -> None:
    with _connect(server) as sock:
        sock.sendall(sent)
        assert _read_until_closed(sock) == b""


def test_kept_alive_connection_outlives_the_header_timeout(server: ServerProcess) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLOSE_DEADLINE_S)
    try:
        conn.request("GET", "/v1/models")
        first = conn.getresponse()
        first.read()
        assert first.status == 200
        # Idle between requests for longer than the header timeout: uvicorn's keep-alive
        # timeout (30 s) governs here, so the connection must still carry a second request
        # (http.client raises RemoteDisconnected if it was closed).
        time.sleep(HEADER_TIMEOUT_S * 1.5)
        conn.request("GET", "/v1/models")
        second = conn.getresponse()
        assert second.status == 200
        assert json.loads(second.read())["data"]
    finally:
        conn.close()


def test_blank_lines_after_a_response_are_closed(server: ServerProcess) -> None:
    """The next head on a kept-alive connection is timed too, once bytes of it arrive."""
    with _connect(server) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(4096)  # the socket's timeout bounds each wait
            assert chunk, received
            received += chunk
        assert _status(received) == 200
        sock.sendall(b"\r\n\r\n\r\n")
        # Bytes arriving stop uvicorn's keep-alive timer; only the header timeout closes this.
        _read_until_closed(sock)


def _request_bytes(body: bytes) -> tuple[bytes, bytes]:
    head = (
        b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    return head, body


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def test_slow_head_within_the_timeout_is_served(server: ServerProcess) -> None:
    head, body = _request_bytes(json.dumps({"content": "hello"}).encode())
    with _connect(server) as sock:
        for i in range(0, len(head), len(head) // 4):
            sock.sendall(head[i : i + len(head) // 4])
            time.sleep(HEADER_TIMEOUT_S / 10)
        sock.sendall(body)
        response = _read_until_closed(sock)
    assert _status(response) == 200, response
    assert json.loads(response.split(b"\r\n\r\n", 1)[1])["tokens"]


def test_slow_body_after_a_complete_head_is_served(server: ServerProcess) -> None:
    head, body = _request_bytes(json.dumps({"content": "hello"}).encode())
    with _connect(server) as sock:
        sock.sendall(head + body[:3])
        # The head is complete: the header timeout no longer applies to this request.
        time.sleep(HEADER_TIMEOUT_S * 1.5)
        sock.sendall(body[3:])
        response = _read_until_closed(sock)
    assert _status(response) == 200, response
