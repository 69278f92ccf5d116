"""A client that leaves a large ``/v1/embeddings`` request frees the engine: the inputs not
yet run are dropped, not computed (a real server process on the embedding demo model,
small batches so that the request takes dozens of steps)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from embedding_support import embedding_demo_dir
from support import serving

pytestmark = pytest.mark.demo

N_INPUTS = 512
BATCH = 16  # --max-batch-size: the request takes N_INPUTS / BATCH = 32 steps


@pytest.fixture(scope="module")
def server():
    with serving(["--model", str(embedding_demo_dir()), "--max-batch-size", str(BATCH)]) as sp:
        yield sp


def health(server) -> dict:
    return httpx.get(server.base_url + "/health", timeout=30).json()


def wait_for(server, condition, what: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition(state := health(server)):
            return state
        # Not faster: on a 2-core CPU a client polling at 20 Hz slows the engine's
        # multi-threaded matmuls several times over.
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {health(server)}")


def raw_request(port: int, body: dict) -> socket.socket:
    """Send a POST and return the socket without reading the answer."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head + payload)
    return sock


def test_a_client_gone_drops_the_inputs_not_yet_run(server):
    texts = [f"Passage {i}: " + "a passage of words " * 4 for i in range(N_INPUTS)]
    before = health(server)["embedding_batches"]
    sock = raw_request(server.port, {"input": texts, "truncate": True})
    try:
        seen = wait_for(server, lambda h: h["embedding_batches"] > before, "the request to run")
    finally:
        sock.close()  # the client leaves mid-request
    done = wait_for(
        server, lambda h: h["waiting_inputs"] == 0 and h["active"] == 0, "the engine to free"
    )
    ran = done["embedding_batches"] - before
    # What ran: the steps before the client left and the one in flight, not the other ~60.
    assert ran <= seen["embedding_batches"] - before + 3, (seen, done)
    assert ran < N_INPUTS // BATCH // 2, done
    r = httpx.post(server.base_url + "/v1/embeddings", json={"input": ["still here"]}, timeout=60)
    assert r.status_code == 200 and len(r.json()["data"]) == 1
