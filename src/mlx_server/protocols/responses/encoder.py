"""The ``Encoder`` of a Responses API response: every event of ``stream.ResponseEncoder``
streamed, or the final response object."""

from __future__ import annotations

from typing import Any

from mlx_server.engine.core.handle import Started
from mlx_server.events import Finished
from mlx_server.protocols.responses.stream import Event, ResponseEncoder
from mlx_server.server.sse import Frame


class ResponseFrames:
    """The ``Encoder`` of one response: every event streamed, or the final response object."""

    keepalive = Frame(comment="keep-alive")

    def __init__(self, enc: ResponseEncoder):
        self.enc = enc

    @staticmethod
    def frames(events: list[Event]) -> list[Frame]:
        return [Frame(e, event=e["type"]) for e in events]

    def open(self, collect: bool) -> list[Frame]:
        # Collected or not, the response is built as it goes: it is retrievable while live.
        return self.frames(self.enc.start())

    def start(self, index: int, started: Started) -> list[Frame]:
        return []

    def event(self, index: int, ev: Any) -> list[Frame]:
        return self.frames(self.enc.event(ev))

    def finish(self, index: int, fin: Finished) -> list[Frame]:
        return self.frames(self.enc.finish(fin))

    def end(self) -> list[Frame]:
        return []

    def fail(self, message: str, fin: Finished | None) -> list[Frame]:
        """A failed generation ends the response as ``response.failed``; an internal fault
        also sends the spec's ``error`` event first."""
        return self.frames(self.enc.finish(fin) if fin is not None else self.enc.fail(message))

    def result(self) -> dict[str, Any]:
        return self.enc.response()
