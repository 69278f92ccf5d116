"""The test helpers' servers never lose a race for their port: a port found free and taken
before the server binds it is a retry (process servers) or never happens (in-process
servers bind their socket first)."""

from __future__ import annotations

import socket

import httpx
import support
from support import demo_model_dir, serving


def test_a_process_server_whose_port_was_taken_starts_on_another(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    real, handed = support.free_port, []

    def first_taken() -> int:
        handed.append(taken if not handed else real())
        return handed[-1]

    monkeypatch.setattr(support, "free_port", first_taken)
    try:
        args = ["--model", str(demo_model_dir(float32=False)), "--ctx-size", "512"]
        with serving(args) as sp:
            assert sp.port != taken and len(handed) == 2
            assert httpx.get(f"http://127.0.0.1:{sp.port}/health", timeout=10).status_code == 200
    finally:
        held.close()
