"""The ``Encoder`` of a Messages response: the stream's events (``stream.StreamEncoder``) as
SSE frames, or folded into the whole ``message`` object (``accumulator.MessageAccumulator``)
for a non-streaming response, so both forms always carry the same message."""

from __future__ import annotations

from typing import Any

from mlx_server.engine.core.handle import Started
from mlx_server.events import Finished, TextDelta
from mlx_server.logs import log
from mlx_server.protocols.anthropic.accumulator import MessageAccumulator
from mlx_server.protocols.anthropic.errors import error_json
from mlx_server.protocols.anthropic.stream import StreamEncoder
from mlx_server.server.sse import Frame


def frames(events: list[dict[str, Any]]) -> list[Frame]:
    return [Frame(e, event=e["type"]) for e in events]


PING = Frame({"type": "ping"}, event="ping")


class MessagesEncoder:
    """The ``Encoder`` of one Messages response: stream events, or folded into a whole
    message."""

    def __init__(self, enc: StreamEncoder):
        self.enc = enc
        self.acc: MessageAccumulator | None = None  # while collecting
        self.opened = False

    @property
    def keepalive(self) -> Frame:
        """Anthropic's own keep-alive, a ``ping`` event, once ``message_start`` went out
        (the first event of a stream); a comment line while the request still queues."""
        return PING if self.opened else Frame(comment="keep-alive")

    def _frames(self, events: list[dict[str, Any]]) -> list[Frame]:
        if self.acc is None:
            return frames(events)
        for e in events:
            self.acc.add(e)
        return []

    def open(self, collect: bool) -> list[Frame]:
        self.acc = MessageAccumulator() if collect else None
        return []

    def start(self, index: int, started: Started) -> list[Frame]:
        # message_start reports the prompt's cache split, known once the engine started it.
        self.opened = True
        return self._frames(self.enc.start(started.cached_tokens))

    def event(self, index: int, ev: Any) -> list[Frame]:
        if self.acc is None and type(ev) is TextDelta:  # the hot path: more of a text block
            data = self.enc.more_text(ev.text)
            if data is not None:
                return [Frame(data, event="content_block_delta")]
        return self._frames(self.enc.event(ev))

    def finish(self, index: int, fin: Finished) -> list[Frame]:
        # A request cancelled while it waited ends without a start: the message opens here.
        opening = [] if self.opened else self.start(index, Started(0))
        return opening + self._frames(self.enc.finish(fin))

    def end(self) -> list[Frame]:
        return []

    def fail(self, message: str, fin: Finished | None) -> list[Frame]:
        return frames([error_json("api_error", message)])

    def result(self) -> dict[str, Any]:
        assert self.acc is not None
        msg = self.acc.message
        kinds = ", ".join(b["type"] for b in msg["content"]) or "none"
        log(f"Response: blocks [{kinds}], stop_reason={msg['stop_reason']}")
        return msg
