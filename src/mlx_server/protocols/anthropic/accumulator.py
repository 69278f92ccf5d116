"""Anthropic Messages stream events folded into the whole ``message`` object: a
non-streaming response is the stream's events folded, so both forms carry the same message."""

from __future__ import annotations

import copy
from typing import Any

from mlx_server.parsing.json_scan import loads


class MessageAccumulator:
    """Folds stream events into the final ``message`` object (the non-streaming body)."""

    def __init__(self) -> None:
        self.message: dict[str, Any] = {}
        self._json: dict[int, str] = {}

    def add(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "message_start":
            self.message = copy.deepcopy(event["message"])
        elif kind == "content_block_start":
            self.message["content"].append(copy.deepcopy(event["content_block"]))
        elif kind == "content_block_delta":
            self._delta(event["index"], event["delta"])
        elif kind == "content_block_stop":
            block = self.message["content"][event["index"]]
            if block["type"] == "tool_use":
                block["input"] = _parse_input(self._json.pop(event["index"], ""))
        elif kind == "message_delta":
            self.message.update({k: v for k, v in event["delta"].items() if k != "container"})
            self.message["usage"].update({k: v for k, v in event["usage"].items() if v is not None})

    def _delta(self, index: int, delta: dict[str, Any]) -> None:
        block = self.message["content"][index]
        kind = delta["type"]
        if kind == "text_delta":
            block["text"] += delta["text"]
        elif kind == "thinking_delta":
            block["thinking"] += delta["thinking"]
        elif kind == "signature_delta":
            block["signature"] = delta["signature"]
        elif kind == "input_json_delta":
            self._json[index] = self._json.get(index, "") + delta["partial_json"]


def _parse_input(text: str) -> dict[str, Any]:
    """A tool_use block's ``input`` object; ``{}`` when the arguments were cut short."""
    if not text.strip():
        return {}
    try:
        value = loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
