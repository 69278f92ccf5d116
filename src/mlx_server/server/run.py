"""Serving: bind first, then load, then announce readiness once uvicorn accepts connections."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any

import uvicorn

from mlx_server.logs import log
from mlx_server.server.header_timeout import with_header_timeout


class PortInUse(Exception):
    pass


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind and listen before the model loads, so a port clash fails fast and readiness is true."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets it knows are TCP, and
    # without it a response written in two parts waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PortInUse(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Server(uvicorn.Server):
    """uvicorn, plus: cancel generations as soon as a shutdown signal arrives, and print the
    readiness lines only after startup (the socket is already bound)."""

    def __init__(self, config: uvicorn.Config, engine: Any, host: str, port: int):
        super().__init__(config)
        self.engine = engine
        self.host_name = host
        self.port_number = port

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.engine.shutdown(timeout=0)  # streams end now instead of holding shutdown open
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        # Wait for the engine thread to end (it writes the prefix cache's RAM entries to the
        # disk tier, bounded in time): uvicorn re-raises SIGTERM/SIGINT once serve() returns,
        # which ends the process at once.
        await asyncio.to_thread(self.engine.shutdown, 3.0)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            log(f"http server listening on http://{self.host_name}:{self.port_number}")
            log(f"server is listening on {self.host_name}:{self.port_number}")


def serve(
    app: Any,
    engine: Any,
    sock: socket.socket,
    host: str,
    port: int,
    log_level: str = "warning",
    header_timeout_s: float = 30.0,
) -> None:
    config = uvicorn.Config(
        app,
        http=with_header_timeout(header_timeout_s),
        log_level=log_level,
        timeout_graceful_shutdown=2,
        access_log=False,
        lifespan="off",
        timeout_keep_alive=30,
    )
    server = _Server(config, engine, host, port)
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        engine.shutdown(timeout=2)
