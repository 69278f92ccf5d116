"""Run mlx-server with its listening socket created as IPPROTO_TCP, so asyncio sets
TCP_NODELAY on every accepted connection.

``server/run.py`` binds ``socket.socket(family, SOCK_STREAM)`` (protocol 0); asyncio only
sets TCP_NODELAY when the protocol is IPPROTO_TCP, so a response written in two parts
(headers, then body) on a kept-alive connection waits for the client's delayed ACK, about
40 ms. This launcher measures the server with that fixed:

    .venv/bin/python bench/throughput.py --only health --ours-launcher bench/serve_tcp_nodelay.py
"""

from __future__ import annotations

import socket
import sys

import mlx_server.server.run as run
from mlx_server.cli import main


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    run.bind_socket = bind_socket
    sys.exit(main())
