"""A client that goes away while its long prompt is still being prefilled frees its slot
at once, on both APIs, streamed or not: the real server on the tiny model, prefilling in
small chunks so that a long prompt takes hundreds of steps."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest
from support import serving

LONG = " ".join(["hello world"] * 600)  # about 3,600 tokens


@pytest.fixture(scope="module")
def slow_prefill_server(tiny_model_dir, tmp_path_factory):
    args = ["-m", str(tiny_model_dir), "--ctx-size", "4096"]
    with serving([*args, "--prefill-step-size", "8", "--prompt-cache-size", "0"]) as sp:
        yield sp


def health(sp) -> dict:
    return httpx.get(sp.base_url + "/health", timeout=10).json()


def wait_idle(sp, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while health(sp)["active"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert health(sp)["active"] == 0


def cancelled_line(sp, since: int) -> str:
    """The engine's log line for the cancelled generation, once it appears."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in sp.lines[since:]:
            if " cancelled after " in line or " cancelled while queued" in line:
                return line
        time.sleep(0.02)
    raise AssertionError(f"no cancellation logged: {sp.lines[since:]}")


def assert_cut_during_prefill(line: str) -> None:
    m = re.search(r"after (\d+) of (\d+) prompt tokens prefilled, (\d+) generated", line)
    assert m, line
    done, todo, generated = map(int, m.groups())
    assert todo > 3000 and done < todo and generated == 0, line


def wait_prefilling(sp) -> None:
    deadline = time.monotonic() + 30
    while not health(sp)["active"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert health(sp)["active"] == 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}),
        ("/v1/messages", {"messages": [{"role": "user", "content": LONG}]}),
    ],
)
def test_a_stream_closed_during_prefill_frees_the_slot(slow_prefill_server, path, body):
    sp = slow_prefill_server
    since = len(sp.lines)
    body = {"model": "m", "max_tokens": 50, "stream": True, **body}
    with httpx.stream("POST", sp.base_url + path, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # kept: dropping the iterator would close the stream
        next(lines)  # the stream has begun: the prompt is prefilling
        wait_prefilling(sp)
    wait_idle(sp)
    assert_cut_during_prefill(cancelled_line(sp, since))


def test_a_non_stream_request_dropped_during_prefill_frees_the_slot(slow_prefill_server):
    sp = slow_prefill_server
    since = len(sp.lines)
    body = json.dumps(
        {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": LONG}]}
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", sp.port)) as s:
        s.sendall(head.encode() + body)
        wait_prefilling(sp)
    wait_idle(sp)
    assert_cut_during_prefill(cancelled_line(sp, since))
