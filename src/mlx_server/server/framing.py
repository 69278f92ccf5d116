"""How a stream's frames go on the wire: Server-Sent Events (OpenAI, Anthropic, Responses)
or newline-delimited JSON (Ollama). The stream driver writes through one of these."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mlx_server.server import sse
from mlx_server.server.sse import Frame, RawJSON, json_text


@dataclass(frozen=True)
class Framing:
    media_type: str
    encode: Callable[[Frame], bytes]
    headers: dict[str, str] = field(default_factory=dict)


def ndjson_line(frame: Frame) -> bytes:
    """One JSON value per line. A failure is Ollama's ``{"error": "..."}`` line; comments
    have no NDJSON form (an Ollama encoder's keep-alive is a chunk of its own)."""
    if frame.error is not None:
        return json_text({"error": frame.error}).encode() + b"\n"
    if frame.comment is not None or frame.data is None:
        return b""
    if isinstance(frame.data, RawJSON):
        return frame.data.text + b"\n"
    return json_text(frame.data).encode() + b"\n"


SSE = Framing("text/event-stream", sse.encode, sse.HEADERS)
NDJSON = Framing("application/x-ndjson", ndjson_line, sse.HEADERS)
