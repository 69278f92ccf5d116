"""A request head must arrive in time: uvicorn's HTTP protocol with a header timeout.

uvicorn waits for a request line forever: a client that connects and sends nothing, only
blank lines, or half a head holds its connection (and a file descriptor) for good. As nginx's
``client_header_timeout``, a timer runs from the moment a head is due (the connection opens,
or data arrives after the previous response) until the head is complete, and closes the
connection when it fires. Between requests uvicorn's own keep-alive timeout still applies;
bodies and streamed responses are not timed here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol; the connection closes when a head takes longer than
    ``header_timeout_s``. Built with :func:`with_header_timeout`."""

    header_timeout_s: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Bytes after a finished response start the next head (blank lines included, which
        # the parser skips without starting a message); bytes during a request are its body.
        if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm_head_timer()
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class to hand uvicorn as ``http=``: uvicorn builds one per connection
    with its own arguments, so the timeout travels on a subclass."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": seconds})
